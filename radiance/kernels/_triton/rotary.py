"""Rotary embedding ("rotate half" layout) of q and k for one token per program, in one launch; with
STORE_KV the rotated k and the v of the token go straight to their paged-cache slot instead of a k
output (the attention kernels read K/V from the cache only), saving the separate KV-store launch.

Same math as layers/rotary.py: fp32 rotation with fp32 cos/sin tables, rounded to the input dtype.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff


@triton.jit
def _rotate_heads(src_row, dst_row, stride_h, heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates `heads` heads at src_row (head stride stride_h) into dst_row (heads contiguous)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    live = h < heads
    src = src_row + h * stride_h + d
    x1_raw = tl.load(src, mask=live, other=0.0)
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    dst = dst_row + h * 2 * HALF + d
    tl.store(dst, (x1 * cos - x2 * sin).to(x1_raw.dtype), mask=live)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(x1_raw.dtype), mask=live)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                  stride_kh, q_heads, k_heads, v_ptr, v_out_ptr, slot_ptr, stride_vt, stride_vh, stride_cs,
                  HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, STORE_KV: tl.constexpr,
                  PDL: tl.constexpr = False):
    """k_out / v_out: [T, Hkv, D] outputs, or (STORE_KV) the k / v caches [blocks, block_size, Hkv, D]
    with slot stride stride_cs, written at slot_ptr[t] (-1: a padding token, nothing written)."""
    pdl_handoff(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + d)
    sin = tl.load(sin_ptr + pos * HALF + d)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * q_heads * 2 * HALF, stride_qh, q_heads, cos, sin, HALF,
                  BLOCK_QH)
    if STORE_KV:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            row = slot.to(tl.int64) * stride_cs
            _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + row, stride_kh, k_heads, cos, sin, HALF, BLOCK_KH)
            h = tl.arange(0, BLOCK_KH)[:, None]
            dd = tl.arange(0, 2 * HALF)[None, :]
            live = h < k_heads
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dd, mask=live)
            tl.store(v_out_ptr + row + h * 2 * HALF + dd, v, mask=live)
    else:
        _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * k_heads * 2 * HALF, stride_kh, k_heads, cos, sin, HALF,
                      BLOCK_KH)
