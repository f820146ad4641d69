"""Launchers for per-token fp8 activation quantization (plain and fused with RMSNorm).

On CUDA (or any device under the Triton interpreter) they run the Triton kernels; elsewhere the
torch reference, which computes the same bytes.
"""

from __future__ import annotations

import torch

from radiance import env
from radiance.kernels import reference
from radiance.kernels._triton import act_quant as _act

MAX_ROW = 65536  # one row lives in registers


def triton_serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on t's device (CUDA, or the CPU interpreter)."""
    return t.is_cuda or env.triton_interpret()


def _row_launch(k: int) -> tuple[int, int]:
    block = max(triton_next_pow2(k), 16)
    return block, max(1, min(16, block // 1024))


def triton_next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q e4m3 [M, K], x_scale fp32 [M, 1]) with M the product of the leading dims."""
    x2 = _as_rows(x)
    m, k = x2.shape
    if not triton_serves(x2) or k > MAX_ROW or m == 0:
        return reference.quantize_activations_reference(x2)
    x_q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    x_scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    block, warps = _row_launch(k)
    _act.quantize_rows_kernel[(m,)](x2, x_q, x_scale, k, x2.stride(0), BLOCK=block,
                                     ROUND_IN_FP32=not x2.is_cuda, num_warps=warps)
    return x_q, x_scale


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RMSNorm + per-token fp8 quantization: quantize_activations(weight * rms_norm(x))."""
    x2 = _as_rows(x)
    m, k = x2.shape
    if weight.shape != (k,):
        raise ValueError(f"rmsnorm_quant: weight shape {tuple(weight.shape)} does not match hidden size {k}")
    if not triton_serves(x2) or k > MAX_ROW or m == 0:
        return reference.rmsnorm_quant_reference(x2, weight, eps)
    x_q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    x_scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    block, warps = _row_launch(k)
    _act.rmsnorm_quantize_rows_kernel[(m,)](x2, weight.contiguous(), x_q, x_scale, k, x2.stride(0), float(eps),
                                            BLOCK=block, ROUND_IN_FP32=not x2.is_cuda, num_warps=warps)
    return x_q, x_scale
