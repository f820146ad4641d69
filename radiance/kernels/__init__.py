"""W4A8 MXFP4 kernels for GPUs without FP4 tensor cores, with their exact torch references.

Launchers live next to the references; the Triton jit bodies are in `radiance.kernels._triton`.
"""

from radiance.kernels.activation import quantize_activations
from radiance.kernels.norm import rmsnorm_quant
from radiance.kernels.prepare import PreparedMxfp4, dequantize_prepared, prepare_mxfp4, unprepare_mxfp4
from radiance.kernels.reference import (quantize_activations_reference, relative_error, rmsnorm_quant_reference,
                                        w4a8_matmul_reference, w4a8_reference)
from radiance.kernels.tuning import GemmConfig, select_config
from radiance.kernels.w4a8 import expand_weight_fp8, w4a8_gemm

__all__ = [
    "quantize_activations", "rmsnorm_quant", "PreparedMxfp4", "prepare_mxfp4", "dequantize_prepared",
    "unprepare_mxfp4", "quantize_activations_reference", "rmsnorm_quant_reference", "w4a8_reference",
    "w4a8_matmul_reference", "relative_error", "GemmConfig", "select_config", "w4a8_gemm", "expand_weight_fp8",
]
