"""Qwen3.5's linear-attention epilogue in one launch: the gated RMSNorm of each value head (gated_delta.gated_rms_norm)
and the per-token e4m3 quantization of the token's H * D values for out_proj, a W4A8 linear
(activation.quantize_activations). Was two launches and a bf16 round trip through memory: one launch fewer per
linear-attention layer per step. Same roundings as the two kernels, so the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import _row_scale, _to_e4m3
from radiance.kernels._triton.gated_delta import _FLOATS, _next_pow2
from radiance.kernels.activation import Fp8Activations, fp8_outputs

MAX_TILE = 16384  # values one program holds ([BLOCK_H, BLOCK_D], padded): beyond it registers spill


def gated_rms_norm_quant(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activations:
    """quantize_activations(gated_rms_norm(x, gate, weight, eps).reshape(B, H * D)) in one launch: x [B * H, D]
    (contiguous; rows of token b are b * H .. b * H + H - 1), gate [B, H, D] (a view of the input projection's z:
    rows and heads may be strided, D contiguous), weight [D]. Returns Fp8Activations(x_q e4m3 [B, H * D],
    x_scale fp32 [B, 1], x.dtype, (B,))."""
    if (x.dim() != 2 or gate.dim() != 3 or gate.shape[0] * gate.shape[1] != x.shape[0]
            or gate.shape[2] != x.shape[1] or weight.shape != (x.shape[1],)):
        raise ValueError(f"gated_rms_norm_quant expects x [B * H, D], gate [B, H, D] and weight [D]; got "
                         f"{tuple(x.shape)}, {tuple(gate.shape)}, {tuple(weight.shape)}")
    if not (x.is_contiguous() and gate.stride(2) == 1 and weight.is_contiguous()):
        raise ValueError("gated_rms_norm_quant: x and weight must be contiguous, and the gate's last dim")
    if x.dtype not in _FLOATS:
        raise ValueError(f"gated_rms_norm_quant: x must be float32, float16 or bfloat16, got {x.dtype}")
    B, H, D = gate.shape
    block_h, block_d = _next_pow2(H), _next_pow2(D)
    tile = block_h * block_d
    if tile > MAX_TILE:
        raise ValueError(f"gated_rms_norm_quant: H * D = {H} * {D} pads to a {block_h} x {block_d} tile, over the "
                         f"{MAX_TILE} values one program holds")
    x_q, x_scale = fp8_outputs(B, H * D, x.device)
    if B:
        gated_rms_norm_quant_kernel[(B,)](x, gate, weight, x_q, x_scale, H, D, gate.stride(0), gate.stride(1),
                                          float(eps), BLOCK_H=block_h, BLOCK_D=block_d, INTERPRETER=not x.is_cuda,
                                          num_warps=max(1, min(8, tile // 1024)))
    return Fp8Activations(x_q, x_scale, x.dtype, (B,))


@triton.jit
def gated_rms_norm_quant_kernel(x_ptr, gate_ptr, w_ptr, xq_ptr, scale_ptr, H, D, stride_gb, stride_gh, eps,
                                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETER: tl.constexpr):
    """Grid [B]: token b's H heads as one [BLOCK_H, BLOCK_D] tile. Per head gated_rms_norm_kernel's math, then
    _quantize_row's on the token's rounded H * D values (its reductions over both axes)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    live = (h < H) & (d < D)
    x = tl.load(x_ptr + (b * H + h) * D + d, mask=live, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0)
    scaled = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)  # the weight product, rounded as torch rounds it
    z = tl.load(gate_ptr + b * stride_gb + h * stride_gh + d, mask=live, other=0.0).to(tl.float32)
    y = (scaled.to(tl.float32) * z * tl.sigmoid(z)).to(x.dtype).to(tl.float32)
    y = tl.where(live, y, 0.0)  # padding heads are NaN when eps is 0 (rsqrt(0) * 0): keep them out of the scale
    amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
    scale = _row_scale(amax, tl.sum(tl.sum((y != y).to(tl.int32), axis=1), axis=0) > 0)
    tl.store(xq_ptr + b * H * D + h * D + d, _to_e4m3(y, scale, INTERPRETER), mask=live)
    tl.store(scale_ptr + b, scale)
