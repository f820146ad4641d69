"""Exact torch references for the W4A8 kernels (fp32 math; CPU and CUDA).

These define what the Triton kernels compute; the kernels are tested against them and the layer
falls back to them where no kernel serves it (CPU, GPUs other than sm_89/sm_90).
"""

from __future__ import annotations

import torch

from radiance.formats import dequantize_mxfp4

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)  # keeps all-zero tokens finite and their scale representable


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic e4m3: x [M, K] -> (x_q e4m3 [M, K], x_scale fp32 [M, 1]).

    scale = max(amax / 448, 1/(448*512)); x_q = e4m3(clamp(x / scale, -448, 448)), round to nearest
    even, all in fp32. A NaN or inf only affects its own row.
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: PyTorch's CUDA division by a Python scalar multiplies by the reciprocal (not IEEE)
    scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=MIN_SCALE)
    x_q = torch.clamp(x32 / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q, scale


def rms_normalize_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the models compute it: fp32 statistics, the weight applied in x's dtype."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(rms_norm(x)): what the fused norm + quant kernel computes."""
    return quantize_activations_reference(rms_normalize_reference(x, weight, eps))


def w4a8_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(x_q * x_scale) @ w.T (+ bias) from already quantized activations and an fp32 weight [N, K].

    fp32 math on the CPU; fp64 on CUDA, where cuBLAS may run fp32 products on TF32 tensor cores
    (seen on the H200: 2-6e-3 disagreement at M >= 3, none at M <= 2 where it uses GEMV)."""
    acc_dtype = torch.float64 if x_q.is_cuda else torch.float32
    acc = torch.matmul(x_q.to(acc_dtype), w.to(acc_dtype).t()) * x_scale.to(acc_dtype)
    if bias is not None:
        acc = acc + bias.to(acc_dtype)
    return acc.float().to(out_dtype)


def w4a8_reference(x: torch.Tensor, packed: torch.Tensor, scale_e8m0: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Exact W4A8 reference: fp8-quantized x [..., K] times the dequantized MXFP4 weight, fp32 math, x.dtype out."""
    w = dequantize_mxfp4(packed, scale_e8m0)
    lead = x.shape[:-1]
    x_q, x_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]))
    out = w4a8_matmul_reference(x_q, x_scale, w.to(x.device), bias, x.dtype)
    return out.reshape(*lead, w.shape[0])


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN when either holds a NaN, so NaN never passes)."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm()
    if denom == 0:
        return float((out64 - ref64).norm())
    return float((out64 - ref64).norm() / denom)
