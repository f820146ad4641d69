"""FP8 e4m3 weights: per output channel or per tensor (compressed-tensors `float-quantized`, strategy channel /
tensor), or per block of rows and K (transformers' `fp8` quant_method with weight_block_size, compressed-tensors'
strategy block): their scales are kept expanded to one row each, [N, ceil(K / block_k)]."""

from __future__ import annotations

import torch

from radiance.formats._checks import check_finite, check_matrix

FP8_E4M3_MAX = 448.0
FP32_TINIEST = 2.0 ** -149  # the smallest positive (subnormal) fp32


def quantize_fp8_per_channel(w: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (w8 float8_e4m3fn [N, K], scale fp32 [N, 1]) with w ~= w8 * scale. power_of_two: each
    scale the power of two at or above amax / 448, which keeps values of few significant bits exact (MXFP4's,
    e2m1 codes times power-of-two block scales: exact in a row whose blocks span at most 14 binades)."""
    check_matrix(w, "w")
    if not w.is_floating_point():
        raise ValueError(f"quantize_fp8_per_channel needs a floating-point weight, got {w.dtype}")
    check_finite(w, "w")
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    # A divisor on amax's device: CUDA turns division by a Python number into a product with its
    # rounded reciprocal, which made the GPU's scales differ from the CPU's in the last bit.
    scale = amax / amax.new_full((), FP8_E4M3_MAX)
    # Rows below ~3e-43 would get scale amax/448 = 0 and then NaN codes: floor it at the tiniest fp32.
    scale = torch.where(amax > 0, scale.clamp(min=FP32_TINIEST), torch.ones_like(amax))
    if power_of_two:  # frexp's exponent: 2 ** e >= scale; scale itself when it is a power of two already
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    w8 = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def dequantize_fp8_per_channel(w8: torch.Tensor, scale: torch.Tensor, block_k: int = 0) -> torch.Tensor:
    """w8 * scale; with `block_k`, scale [N, ceil(K / block_k)] holds one scale per row and block of K."""
    check_matrix(w8, "w8")
    if w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {w8.dtype}")
    scale = torch.as_tensor(scale, device=w8.device).float()
    n, k = w8.shape
    if block_k:
        if tuple(scale.shape) != (n, -(-k // block_k)):
            raise ValueError(f"FP8 block scales must be [{n}, {-(-k // block_k)}] for K={k} in blocks of {block_k}, "
                             f"got {tuple(scale.shape)}")
        return w8.float() * scale.repeat_interleave(block_k, dim=1)[:, :k]
    if scale.numel() == n:
        scale = scale.reshape(-1, 1)
    elif scale.numel() != 1:
        raise ValueError(f"FP8 scale must be per-channel [{n}, 1] or per-tensor, got {tuple(scale.shape)}")
    return w8.float() * scale
