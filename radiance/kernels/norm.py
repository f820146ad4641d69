"""Launchers of the residual-add RMSNorm: `add_rmsnorm` (s = x + residual and y = weight * rms_norm(s), y optionally
quantized to per-token fp8), over a tensor or over a W4A8 GEMM's split-K `PartialSums`, and `rmsnorm_quant`
(RMSNorm + fp8 quantize, no residual).

On CUDA (or any device under the Triton interpreter) they run one Triton kernel; elsewhere the
torch reference, which computes the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radiance.kernels import reference
from radiance.kernels._triton import act_quant as _act
from radiance.kernels.activation import Fp8Activations, fp8_outputs
from radiance.kernels.device_info import supports_pdl
from radiance.kernels.triton_support import MAX_ROW, as_rows, releases_early, row_launch, triton_serves

FEW_ROWS = 8  # up to this many rows the norm summing split-K partials runs 32 warps per row


class PartialSums(NamedTuple):
    """A W4A8 GEMM's output [M, N] left as its fp32 split-K partials, parts [S, M, W >= N], for the kernel
    that reads it next to sum (add_rmsnorm): output = parts[0] + parts[1] + ... (columns :N), added in
    that order in fp32 and rounded to `dtype`, the bytes of the GEMM's own last-arrival sum. `lead`: the
    output's leading shape (w4a8.w4a8_gemm_partials)."""

    parts: torch.Tensor
    width: int
    dtype: torch.dtype
    lead: tuple[int, ...]

    def total(self) -> torch.Tensor:
        """The output itself, [*lead, N] in dtype."""
        total = torch.zeros_like(self.parts[0, :, :self.width])
        for part in self.parts:
            total += part[:, :self.width]
        return total.to(self.dtype).reshape(*self.lead, self.width)


def add_rmsnorm(x: torch.Tensor | PartialSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                quantize: bool = False, keep_values: bool = False, launch: str = "norm"):
    """One kernel for a decoder layer's pre-norm: (y, s) with s = x + residual (x when residual is
    None) and y = weight * rms_norm(s), rounded as the model's RMSNorm does; y is Fp8Activations when
    `quantize`, holding y itself as `values` too with `keep_values`. x may be a GEMM's PartialSums, summed
    as the kernel reads them (the bytes of their total); without a residual their sum is not kept (s is None:
    Gemma's norms of the attention and MLP outputs). Triton on CUDA (and under the interpreter); the torch
    reference elsewhere. `launch` names the norm for PDL_EARLY_RELEASE."""
    parts = None
    if isinstance(x, PartialSums):
        if not triton_serves(x.parts) or x.width > MAX_ROW or x.parts.shape[1] == 0:
            x = x.total()
        elif x.parts.stride(2) != 1:
            raise ValueError("add_rmsnorm: partials need contiguous rows")
        else:
            parts = x
    if parts is not None:  # the kernel reads [S, M, W] fp32 rows
        x2, (m, k), dtype, lead = parts.parts, (parts.parts.shape[1], parts.width), parts.dtype, parts.lead
    else:
        x2 = as_rows(x)
        (m, k), dtype, lead = x2.shape, x.dtype, tuple(x.shape[:-1])
    if weight.shape != (k,):
        raise ValueError(f"add_rmsnorm: weight shape {tuple(weight.shape)} does not match hidden size {k}")
    r2 = as_rows(residual) if residual is not None else None
    if parts is None and (not triton_serves(x2) or k > MAX_ROW or m == 0):
        s = x2 + r2 if r2 is not None else x2
        y = reference.rms_normalize_reference(s, weight, eps)
        out = Fp8Activations(*reference.quantize_activations_reference(y), x.dtype, lead,
                             y.reshape(x.shape) if keep_values else None) if quantize else y.reshape(x.shape)
        return out, s.reshape(x.shape)
    keeps_sum = r2 is not None or parts is None
    if r2 is not None:
        s = torch.empty((m, k), dtype=dtype, device=x2.device)
    else:  # partials without a residual: an empty s only tells the kernel the dtype their sum is rounded to
        s = x2 if parts is None else torch.empty((0,), dtype=dtype, device=x2.device)
    keep_values = quantize and keep_values
    y = s.new_empty((0,)) if quantize and not keep_values else torch.empty((m, k), dtype=dtype, device=x2.device)
    x_q, x_scale = fp8_outputs(m, k, x2.device) if quantize else (y, y)
    block, warps = row_launch(k)
    if parts is not None and m <= FEW_ROWS:
        warps = 32  # one SM reads all of a row's partials: the most loads in flight (8B decode step -17 us)
    pdl = supports_pdl(x2.device)
    _act.add_rmsnorm_rows_kernel[(m,)](
        x2, r2 if r2 is not None else x2, weight.contiguous(), y, s, x_q, x_scale, k, x2.stride(-2),
        r2.stride(0) if r2 is not None else 0, float(eps), x2.stride(0) if parts is not None else 0,
        HAS_RESIDUAL=r2 is not None, QUANT=quantize, PARTS=x2.shape[0] if parts is not None else 0, BLOCK=block,
        INTERPRETER=not x2.is_cuda, PDL=pdl, KEEP_VALUES=keep_values, EARLY_RELEASE=releases_early(launch, pdl),
        launch_pdl=pdl, num_warps=warps)
    shape = (*lead, k)
    out = (Fp8Activations(x_q, x_scale, dtype, lead, y.reshape(shape) if keep_values else None) if quantize
           else y.reshape(shape))
    return out, (s.reshape(shape) if keeps_sum else None)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RMSNorm + per-token fp8 quantization: quantize_activations(weight * rms_norm(x))."""
    act, _ = add_rmsnorm(x, None, weight, eps, quantize=True)
    return act.x_q, act.x_scale
