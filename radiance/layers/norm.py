"""RMSNorm as the HF Llama/Qwen models compute it (fp32 statistics, weight applied in the input dtype), or, with
`fp32_weight`, as HF's Gemma and OLMo 2 do (the weight applied in fp32 and one rounding at the end).

On CUDA the residual add, the norm and (for a W4A8 linear next) the fp8 quantization run as one
Triton kernel (`kernels.norm.add_rmsnorm`); on the CPU the torch code below.
"""

from __future__ import annotations

import torch
from torch import nn

from radiance.kernels.activation import Fp8Activations
from radiance.kernels.norm import PartialSums, add_rmsnorm
from radiance.kernels.reference import quantize_activations_reference
from radiance.kernels.triton_support import MAX_ROW


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if fp32_weight:  # HF Gemma / OLMo 2: (x32 * w32).to(dtype), one rounding (in float32 both orders are one op)
        return (x32 * weight.float()).to(dtype)
    return weight * x32.to(dtype)  # HF Llama: rounded, then times the weight in the input dtype


def weights_in_fp32(module: nn.Module) -> None:
    """Every RMSNorm under `module` takes HF Gemma's / OLMo 2's order (`RMSNorm.fp32_weight`)."""
    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.fp32_weight = True


def scale_by_one_plus_weight(module: nn.Module) -> None:
    """Every RMSNorm under `module` whose checkpoint weight w means a scale of 1 + w (Gemma, Qwen3.5) becomes a norm of
    weight 1 + w, once, after the load, so every norm kernel serves it unchanged. Kept in fp32, as transformers
    computes it (1 + w rounded to bf16 loses w's low bits: a bf16 ulp of the output); the CUDA kernels round it to
    the model's dtype as they load it."""
    with torch.no_grad():
        for norm in module.modules():
            if isinstance(norm, RMSNorm):
                norm.weight = nn.Parameter(norm.weight.float() + 1.0, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, launch: str = "norm"):
        super().__init__()
        self.eps = eps
        self.launch = launch  # which norm of the layer it is, for triton_support.PDL_EARLY_RELEASE
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        # the weight applied in fp32 before the one rounding (HF Gemma, OLMo 2), not after it (HF Llama). Off the GPU
        # only: the CUDA kernels (add_rmsnorm, the rotary's head norm) keep Llama's order
        self.fp32_weight = False

    def forward(self, x: torch.Tensor | PartialSums, residual: torch.Tensor | None = None, fp8: bool = False,
                keep_values: bool = False):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the pre-norm
        residual stream of a decoder layer in one call. `fp8`: the norm comes out as Fp8Activations
        for a W4A8 linear, carrying the 16-bit norm as `values` too with `keep_values` (a sparse MLP's
        router). x may be a GEMM's PartialSums (summed in the fused kernel)."""
        if isinstance(x, PartialSums) and not x.parts.is_cuda:
            x = x.total()  # off the GPU the path of a plain tensor
        if isinstance(x, PartialSums) or (x.is_cuda and x.shape[-1] <= MAX_ROW):
            y, summed = add_rmsnorm(x, residual, self.weight, self.eps, quantize=fp8, keep_values=keep_values,
                                     launch=self.launch)
            return y if residual is None else (y, summed)
        if residual is not None:
            x = x + residual
        y = rms_norm(x, self.weight, self.eps, self.fp32_weight)
        if fp8:
            x_q, x_scale = quantize_activations_reference(y.reshape(-1, y.shape[-1]))
            y = Fp8Activations(x_q, x_scale, y.dtype, tuple(y.shape[:-1]), y if keep_values else None)
        return y if residual is None else (y, x)
