"""Launchers for per-token fp8 activation quantization: `quantize_activations` (one program per row), and
`quantize_rows_from_parts` (rows whose amax the GEMM before left in parts). `Fp8Activations` is what they, the
fused norm (norm.py) and the fused GLU multiply (glu.py) hand a W4A8 linear; `fp8_outputs` allocates it.

On CUDA (or any device under the Triton interpreter) they run the Triton kernels; elsewhere the
torch reference, which computes the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radiance.kernels import reference, triton_support
from radiance.kernels._triton import act_quant as _act
from radiance.kernels.device_info import supports_pdl
from radiance.kernels.triton_support import (CHUNK, MAX_ROW, as_rows, next_pow2, releases_early, row_launch,
                                             triton_serves)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q e4m3 [M, K], x_scale fp32 [M, 1]) with M the product of the leading dims."""
    x2 = as_rows(x)
    m, k = x2.shape
    if not triton_serves(x2) or k > MAX_ROW or m == 0:
        return reference.quantize_activations_reference(x2)
    x_q, x_scale = fp8_outputs(m, k, x2.device)
    block, warps = row_launch(k, m)
    pdl = supports_pdl(x2.device)
    if block > 4096 and 4 * block > 5 * k:  # padding to a power of two would waste over 20%
        # MANY_ROWS read through its module, as row_launch reads it: one setting for both (tests lower it)
        chunk, warps = (2048, warps) if m >= triton_support.MANY_ROWS else (4096, 16)  # many rows: row_launch's warps
        _act.quantize_rows_chunked_kernel[(m,)](x2, x_q, x_scale, k, x2.stride(0), BLOCK=chunk,
                                                INTERPRETER=not x2.is_cuda, PDL=pdl, launch_pdl=pdl,
                                                num_warps=warps)
    else:
        _act.quantize_rows_kernel[(m,)](x2, x_q, x_scale, k, x2.stride(0), BLOCK=block,
                                         INTERPRETER=not x2.is_cuda, PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return x_q, x_scale


class Fp8Activations(NamedTuple):
    """Per-token e4m3 activations ready for a W4A8 linear, made by a fused norm or SiLU-mul kernel:
    x_q [M, K], x_scale fp32 [M, 1]; the linear's output takes `dtype` and the leading shape `lead`.
    `values`: the `dtype` tensor [*lead, K] they quantize, where the producer kept it too (add_rmsnorm's
    keep_values: a sparse MLP's router reads it, its experts the e4m3 codes)."""

    x_q: torch.Tensor
    x_scale: torch.Tensor
    dtype: torch.dtype
    lead: tuple[int, ...]
    values: torch.Tensor | None = None


def fp8_outputs(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (x_q e4m3 [m, k], x_scale fp32 [m, 1]) for a kernel that quantizes m tokens."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quantize_rows_from_parts(y: torch.Tensor, amax_parts: torch.Tensor,
                             launch: str = "parts_quantize") -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(y) for y [M, K] whose row amax the kernel that wrote it left in amax_parts
    (int32 bits [M, P] of |y| maxima over column tiles: w4a8_glu's GEMM): one fully parallel launch,
    M * cdiv(K, CHUNK) programs, none waiting for another. Triton only (CUDA or the interpreter).
    `launch` names it for PDL_EARLY_RELEASE: "parts_quantize" / "prefill_parts_quantize" before a dense GEMM in /
    above the decode band, "moe_parts_quantize" before a grouped one."""
    m, k = y.shape
    x_q, x_scale = fp8_outputs(m, k, y.device)
    if m == 0:
        return x_q, x_scale
    pdl = supports_pdl(y.device)
    parts = amax_parts.shape[1]
    _act.quantize_rows_from_parts_kernel[(m * -(-k // CHUNK),)](
        y, amax_parts, x_q, x_scale, k, parts, y.stride(0), BLOCK=CHUNK, P_PAD=max(2, next_pow2(parts)),
        INTERPRETER=not y.is_cuda, PDL=pdl, EARLY_RELEASE=releases_early(launch, pdl),
        launch_pdl=pdl, num_warps=4)
    return x_q, x_scale
