"""Rotary embedding ("rotate half" layout) of q and k for one token per program, in one launch.

Same math as layers/rotary.py: fp32 rotation with fp32 cos/sin tables, rounded to the input dtype.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_t, stride_h, heads, cos, sin, t, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    live = h < heads
    src = src_ptr + t * stride_t + h * stride_h + d
    x1_raw = tl.load(src, mask=live, other=0.0)
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    dst = dst_ptr + t * heads * 2 * HALF + h * 2 * HALF + d
    tl.store(dst, (x1 * cos - x2 * sin).to(x1_raw.dtype), mask=live)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(x1_raw.dtype), mask=live)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                  stride_kh, q_heads, k_heads, HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + d)
    sin = tl.load(sin_ptr + pos * HALF + d)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, q_heads, cos, sin, t, HALF, BLOCK_QH)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, k_heads, cos, sin, t, HALF, BLOCK_KH)
