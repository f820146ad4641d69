"""Bit-exact FP4 / FP8 codecs and requantization (pure torch, CPU and CUDA).

The reference for everything else: kernels, checkpoint readers and writers are tested against
these functions. See DESIGN.md sections 2 and 3 for the bit-level definitions.
"""

from radiance.formats.e2m1 import E2M1_MAGNITUDES, e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1
from radiance.formats.fp8 import dequantize_fp8_per_channel, quantize_fp8_per_channel
from radiance.formats.int4 import INT4_GROUP, dequantize_int4
from radiance.formats.mxfp4 import MX_BLOCK, RULES, dequantize_mxfp4, quantize_mxfp4
from radiance.formats.nvfp4 import NV_BLOCK, dequantize_nvfp4, quantize_nvfp4
from radiance.formats.requant import dense_to_mxfp4, dense_to_mxfp4_pair, nvfp4_to_mxfp4
from radiance.formats.weights import (DenseWeight, Fp8Weight, Int4Weight, Mxfp4Weight, Nvfp4Weight, Weight,
                                      concat_partitions, dequantize, nbytes, rows_reordered, scaled, to_mxfp4,
                                      weight_to)

__all__ = [
    "E2M1_MAGNITUDES", "MX_BLOCK", "NV_BLOCK", "INT4_GROUP", "RULES",
    "pack_e2m1", "unpack_e2m1", "e2m1_to_float", "round_to_e2m1",
    "quantize_mxfp4", "dequantize_mxfp4", "quantize_nvfp4", "dequantize_nvfp4", "nvfp4_to_mxfp4",
    "quantize_fp8_per_channel", "dequantize_fp8_per_channel", "dense_to_mxfp4", "dense_to_mxfp4_pair",
    "dequantize_int4",
    "DenseWeight", "Mxfp4Weight", "Nvfp4Weight", "Fp8Weight", "Int4Weight", "Weight",
    "concat_partitions", "dequantize", "rows_reordered", "scaled", "to_mxfp4", "nbytes", "weight_to",
]
