"""Linear layers: Mxfp4Linear (4-bit weights on the W4A8 kernel), Mxfp4PairLinear (two 4-bit terms, for an
lm_head) and DenseLinear (16-bit weights).

Each layer decides once, at construction, which path serves it and records why (`.path`,
`.path_reason`); `linear_summary(model)` turns that into the startup line. Nothing falls back
silently: a layer the W4A8 kernel cannot serve runs the exact reference and is counted as such.
Build the layer on the device it will run on (the kernel layout is prepared there).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from radiance.config import KernelConfig
from radiance.formats import MX_BLOCK, dequantize_mxfp4, to_mxfp4
from radiance.kernels import ops  # noqa: F401 - registers torch.ops.radiance.*
from radiance.kernels import reference
from radiance.kernels.activation import Fp8Activations, quantize_activations
from radiance.kernels.device_info import capability
from radiance.kernels.glu import SILU, GluActivation
from radiance.kernels.norm import PartialSums
from radiance.kernels.numerics import NumericsMonitor
from radiance.kernels.prepare import PreparedMxfp4, dequantize_prepared, prepare_mxfp4
from radiance.kernels.w4a8 import deferring_pays, w4a8_gemm_partials

log = logging.getLogger(__name__)

PATH_W4A8 = "w4a8-triton"
PATH_W4A16 = "w4a16"
PATH_REFERENCE = "reference"
PATH_DENSE = "dense"
FP8_GPUS = ((8, 9), (9, 0))  # Ada and Hopper: fp8 tensor cores the kernel is written for


def choose_path(device: torch.device, config: KernelConfig) -> tuple[str, str]:
    if config.activations == "bf16":
        return PATH_W4A16, "activations=bf16: dequantized weights x 16-bit activations"
    if not config.use_triton:
        return PATH_REFERENCE, "use_triton=False"
    if device.type != "cuda":
        return PATH_REFERENCE, f"{device.type}: exact reference path"
    cap = capability(device)
    if cap not in FP8_GPUS:
        return PATH_REFERENCE, f"sm_{cap[0]}{cap[1]}: no fp8 tensor-core kernel for this GPU"
    return PATH_W4A8, f"sm_{cap[0]}{cap[1]}: W4A8 Triton kernel"


def _kernel_op(name: str, *args):
    """Call the W4A8 op `name` (ops.py): torch.compile must see the one opaque op; eager calls skip the
    custom-op dispatcher, which was measured at ~180 us of host time per call on the H200 machine (45 ms
    of a 1k-token 8B prefill), and run its implementation directly."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.radiance, name)(*args)
    return getattr(ops, f"{name}_impl")(*args)


def takes_fp8(linear: nn.Module) -> bool:
    """Whether `linear` runs the W4A8 kernel, so the op before it should hand it Fp8Activations."""
    return getattr(linear, "path", None) == PATH_W4A8


class UnloadedLinear(nn.Module):
    """Stands where a linear will be; calling it means the checkpoint never provided the weight."""

    def __init__(self, in_features: int, out_features: int, partitions: tuple[int, ...] | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.partitions = partitions or (out_features,)

    def forward(self, x):
        raise RuntimeError("linear weight was never loaded")


class Mxfp4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W an MXFP4 weight (packed uint8 [N, K/2], e8m0 scales [N, K/32])."""

    def __init__(self, packed: torch.Tensor, scale_e8m0: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_config: KernelConfig = KernelConfig(), name: str = ""):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.kernel_config = kernel_config
        self.name = name
        self.path, self.path_reason = choose_path(packed.device, kernel_config)
        self.underflow_blocks = 0
        self.register_buffer("bias", bias, persistent=False)
        if self.path == PATH_W4A8:
            prepared = prepare_mxfp4(packed, scale_e8m0)
            self.underflow_blocks = prepared.underflow_blocks
            if prepared.underflow_blocks:
                log.warning("%s: %d MXFP4 blocks lie more than 11 exponents below their row's largest and were "
                            "re-rounded for the fp8 kernel", name or "linear", prepared.underflow_blocks)
            self.register_buffer("w_q", prepared.w_q, persistent=False)
            self.register_buffer("w_shift", prepared.w_shift, persistent=False)
            self.register_buffer("w_ref", prepared.w_ref, persistent=False)
            self.register_buffer("w_scale", prepared.w_scale, persistent=False)
        else:
            w = dequantize_mxfp4(packed, scale_e8m0)  # exact; fp32 for the reference, 16-bit for W4A16
            self.register_buffer("w_dense", w if self.path == PATH_REFERENCE else w.to(torch.bfloat16), persistent=False)
        self.monitor = (NumericsMonitor(name or "linear", kernel_config.numerics_check_every)
                        if kernel_config.numerics_check and self.path == PATH_W4A8 else None)

    @classmethod
    def from_weight(cls, weight, rule: str = "mse", kernel_config: KernelConfig = KernelConfig(),
                    bias: torch.Tensor | None = None, name: str = "") -> tuple["Mxfp4Linear", float]:
        """Any radiance.formats Weight (dense, mxfp4, nvfp4, fp8) -> (layer, relative RMS error of the conversion)."""
        mx, rel_rms = to_mxfp4(weight, rule=rule)
        return cls(mx.packed, mx.scale, bias, kernel_config, name), rel_rms

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, path={self.path}"

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        if isinstance(x, Fp8Activations):  # quantized by the fused norm / SiLU-mul kernel before us
            out = self.forward_quantized(x.x_q, x.x_scale, x.dtype)
            if self.monitor is not None and self.monitor.due():
                self.monitor.check(x.x_q, x.x_scale, self.dequantized_weight(), self.bias, out)
            return out.reshape(*x.lead, self.out_features)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.path == PATH_W4A8:
            out = _kernel_op("w4a8_linear", x2, self.w_q, self.w_shift, self.w_scale, self.bias,
                             self.kernel_config.decode_band)
            if self.monitor is not None and self.monitor.due():
                self.monitor.check(*quantize_activations(x2), self.dequantized_weight(), self.bias, out)
        elif self.path == PATH_W4A16:
            if self.w_dense.dtype != x.dtype:  # a float16 / float32 model: convert once, not on every call
                self.w_dense = self.w_dense.to(x.dtype)
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            out = F.linear(x2, self.w_dense, bias)
        else:
            out = reference.w4a8_matmul_reference(*reference.quantize_activations_reference(x2), self.w_dense,
                                                  self.bias, x.dtype)
        return out.reshape(*lead, self.out_features)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Activations already quantized (rmsnorm_quant / quantize_activations): x_q e4m3 [M, K], x_scale [M, 1]."""
        if self.path == PATH_W4A8:
            return _kernel_op("w4a8_linear_quantized", x_q, x_scale, self.w_q, self.w_shift, self.w_scale, self.bias,
                              out_dtype, self.kernel_config.decode_band)
        if self.path == PATH_W4A16:  # 16-bit activations were asked for: use the dequantized fp8 values
            return self.forward((x_q.float() * x_scale).to(out_dtype))
        return reference.w4a8_matmul_reference(x_q, x_scale, self.w_dense, self.bias, out_dtype)

    def forward_for_norm(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor | PartialSums:
        """forward(x) for an output that a residual-add norm reads next (add_rmsnorm sums PartialSums as it
        reads them): on the W4A8 kernel, with KernelConfig.defer_split_sum, where w4a8.deferring_pays, the
        GEMM's split-K partials, so the GEMM skips its own last-arrival sum (w4a8.w4a8_gemm_partials)."""
        if not self._defers_sum(x):
            return self.forward(x)
        return w4a8_gemm_partials(x.x_q, x.x_scale, self._prepared(), x.dtype,
                                  decode_band=self.kernel_config.decode_band)._replace(lead=x.lead)

    def _defers_sum(self, x) -> bool:
        return (self.path == PATH_W4A8 and self.kernel_config.defer_split_sum and isinstance(x, Fp8Activations)
                and self.bias is None and self.monitor is None and not torch.compiler.is_compiling()
                and deferring_pays(x.x_q.shape[0], self.out_features, self.in_features,
                                   self.kernel_config.decode_band, x.x_q.device))

    def _prepared(self) -> PreparedMxfp4:
        return PreparedMxfp4(self.w_q, self.w_shift, self.w_ref, self.w_scale, self.in_features, 0)

    def fuses_glu(self) -> bool:
        """Whether forward_glu runs as one fused GEMM: the W4A8 kernel, KernelConfig.fuse_glu, and no
        numerics monitor (it checks this layer's own output, which the fused epilogue never writes)."""
        return self.path == PATH_W4A8 and self.kernel_config.fuse_glu and self.monitor is None

    def forward_glu(self, x: torch.Tensor | Fp8Activations, activation: GluActivation = SILU) -> Fp8Activations:
        """For a merged [gate | up] layer (fuses_glu): act(gate) * up of this layer's output (SiLU, or Gemma's
        GeGLU), quantized per token for a W4A8 down projection, with the bytes of glu_mul(self(x), activation,
        quantize=True); the activation happens in the GEMM's epilogue (w4a8.w4a8_glu)."""
        if not isinstance(x, Fp8Activations):
            lead = tuple(x.shape[:-1])
            x = Fp8Activations(*quantize_activations(x.reshape(-1, self.in_features)), x.dtype, lead)
        x_q, x_scale = _kernel_op("w4a8_glu_quantized", x.x_q, x.x_scale, self.w_q, self.w_shift, self.w_scale,
                                  self.bias, x.dtype, self.kernel_config.decode_band, activation.kind)
        return Fp8Activations(x_q, x_scale, x.dtype, x.lead)

    def dequantized_weight(self) -> torch.Tensor:
        """The exact fp32 weight this layer multiplies with."""
        if self.path == PATH_W4A8:
            return dequantize_prepared(self._prepared())
        return self.w_dense.float()


class Mxfp4PairLinear(nn.Module):
    """y = x @ (Q1 + Q2)^T for a 16-bit weight held as two MXFP4 terms side by side along K
    (formats.dense_to_mxfp4_pair): one Mxfp4Linear over 2K, fed [x | x]. Both halves of [x | x] share
    x's per-token amax, so on the W4A8 kernel this is x_q @ (Q1 + Q2)^T in one GEMM reading 8.5 bits per
    weight (the lm_head option ModelConfig.lm_head_format = "mxfp4x2")."""

    def __init__(self, packed: torch.Tensor, scale_e8m0: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_config: KernelConfig = KernelConfig(), name: str = ""):
        super().__init__()
        self.terms = Mxfp4Linear(packed, scale_e8m0, bias, kernel_config, name)
        if self.terms.in_features % (2 * MX_BLOCK):  # each term a whole number of MX blocks
            raise ValueError(f"{name or 'linear'}: two MXFP4 terms side by side need K a multiple of "
                             f"{2 * MX_BLOCK}, got {self.terms.in_features}")
        self.out_features, self.in_features = self.terms.out_features, self.terms.in_features // 2
        self.name = name
        self.path, self.path_reason = self.terms.path, self.terms.path_reason + ", two MXFP4 terms"

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, terms=2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.terms(torch.cat((x, x), dim=-1))

    def dequantized_weight(self) -> torch.Tensor:
        """The exact fp32 weight Q1 + Q2 this layer multiplies with."""
        w = self.terms.dequantized_weight()
        return w[:, :self.in_features] + w[:, self.in_features:]


class DenseLinear(nn.Module):
    """A 16-bit linear (lm_head, layers kept unquantized): F.linear in the activation dtype."""

    path = PATH_DENSE

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = ""):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.name = name
        self.path_reason = "16-bit weight"
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight.to(x.dtype), bias)


def linear_summary(model: nn.Module) -> str:
    """One startup line: "N/N linears on the W4A8 kernel", or who runs elsewhere and why (a model without
    MXFP4 linears: only what serves its linears)."""
    from radiance.layers.int4_linear import Int4Linear

    quantized = [m for m in model.modules() if isinstance(m, Mxfp4Linear)]
    dense = sum(isinstance(m, DenseLinear) for m in model.modules())
    int4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    on_kernel = sum(m.path == PATH_W4A8 for m in quantized)
    parts = [f"{on_kernel}/{len(quantized)} linears on the W4A8 kernel"] if quantized or not (int4 or dense) else []
    others = Counter((m.path, m.path_reason) for m in quantized if m.path != PATH_W4A8)
    parts += [f"{n} on {path} ({why})" for (path, why), n in sorted(others.items())]
    underflow = sum(m.underflow_blocks for m in quantized)
    if underflow:
        parts.append(f"{underflow} weight blocks re-rounded below the fp8 exponent window")
    if int4:
        parts.append(f"{int4} 4-bit GGUF linear{'s' if int4 != 1 else ''} on the int4 CPU kernel")
    if dense:
        parts.append(f"{dense} dense 16-bit linear{'s' if dense != 1 else ''}")
    return "; ".join(parts)
