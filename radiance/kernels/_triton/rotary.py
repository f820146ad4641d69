"""Rotary embedding ("rotate half" layout) of q and k for one token per program, in one launch; with
STORE_KV the rotated k and the v of the token go straight to their paged-cache slot instead of a k
output (the attention kernels read K/V from the cache only), saving the separate KV-store launch.

Same math as layers/rotary.py: fp32 rotation with fp32 cos/sin tables, rounded to the input dtype. With ROT > 0
only each head's leading ROT dims rotate (a partial rotary of at most half the head: GLM-4.5's partial_rotary_factor
0.5, Qwen3.5's 0.25; tables ROT / 2 wide), in pairs ROT / 2 apart; the rest passes through (normed, with NORM).
The decode attention kernel (layers/attention_triton.py) reuses the helpers to rotate and store in
its own launch at decode.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff, round_to_e4m3_grid


def rotates(head_dim: int, rotary_dim: int) -> bool:
    """Whether these kernels rotate heads of head_dim dims (a power of 2) by their leading rotary_dim: the whole head,
    or a power-of-2 part of at most half of it (not Phi-4-mini's three quarters)."""
    if head_dim < 2 or head_dim & (head_dim - 1):
        return False
    return rotary_dim == head_dim or (2 <= rotary_dim <= head_dim // 2 and rotary_dim & (rotary_dim - 1) == 0)


def partial_width(head_dim: int, rotary_dim: int) -> int:
    """The kernels' ROT: 0 for a whole head's rotation, else the rotated dims."""
    return 0 if rotary_dim == head_dim else rotary_dim


@triton.jit
def to_cache(x, ptr, inv_scale):
    """x as the tensor at `ptr` stores it: an fp8 e4m3 KV cache holds x * inv_scale (the inverse of the
    layer's calibrated scale, attention.KvScales), saturating at +-448 and rounding to nearest even (as
    attention.to_cache_dtype does on the torch side; pre-rounded on the e4m3 grid, which the interpreter's
    cast needs and costs the GPU a few instructions per stored element); any other dtype is a plain
    conversion (inv_scale unused)."""
    if ptr.dtype.element_ty == tl.float8e4nv:
        return round_to_e4m3_grid(tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)).to(tl.float8e4nv)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, eps, dtype: tl.constexpr, HALF: tl.constexpr):
    """Qwen3's q_norm / k_norm of each head (rows of the halves x1, x2: fp32 holding dtype values) with
    RMSNorm's rounding (act_quant.add_rmsnorm_rows_kernel): normalized in fp32, rounded to dtype, times
    the weight in dtype."""
    inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    d = tl.arange(0, HALF)[None, :]
    w1 = tl.load(w_ptr + d).to(dtype).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d).to(dtype).to(tl.float32)
    y1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def rotary_tables(cos_ptr, sin_ptr, pos, HALF: tl.constexpr, ROT: tl.constexpr = 0):
    """Position `pos`'s cos and sin [1, HALF] as _rotated_halves takes them: the tables' row, or with ROT (tables
    ROT / 2 wide) each angle for both elements of its pair among the leading ROT dims, sin negated on the pairs'
    first elements, and cos 1, sin 0 past them (those dims pass through)."""
    d = tl.arange(0, HALF)[None, :]
    if ROT:
        PAIR: tl.constexpr = ROT // 2
        rotating = d < ROT
        cos = tl.load(cos_ptr + pos * PAIR + d % PAIR, mask=rotating, other=1.0)
        sin = tl.load(sin_ptr + pos * PAIR + d % PAIR, mask=rotating, other=0.0)
        sin = tl.where(d < PAIR, -sin, sin)
    else:
        cos = tl.load(cos_ptr + pos * HALF + d)
        sin = tl.load(sin_ptr + pos * HALF + d)
    return cos, sin


@triton.jit
def _swap_pairs(x, ROT: tl.constexpr):
    """[rows, WIDTH] with each run of ROT columns' two halves swapped: each element's rotary partner when the leading
    ROT dims rotate in pairs ROT / 2 apart (the later runs' swaps meet cos 1, sin 0)."""
    ROWS: tl.constexpr = x.shape[0]
    WIDTH: tl.constexpr = x.shape[1]
    if ROT == WIDTH:
        low, high = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, WIDTH // 2)), (0, 2, 1)))
        return tl.reshape(tl.permute(tl.join(high, low), (0, 2, 1)), (ROWS, WIDTH))
    else:
        runs = tl.permute(tl.reshape(x, (ROWS, WIDTH // ROT, 2, ROT // 2)), (0, 1, 3, 2))
        low, high = tl.split(runs)
        return tl.reshape(tl.permute(tl.join(high, low), (0, 1, 3, 2)), (ROWS, WIDTH))


@triton.jit
def _rotated_halves(src_row, stride_h, heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    norm_w_ptr=None, eps=0.0, NORM: tl.constexpr = False, ROT: tl.constexpr = 0):
    """The halves (x1 cos - x2 sin, x2 cos + x1 sin), each [BLOCK_H, HALF] in the input dtype, of the
    `heads` heads at src_row (head stride stride_h; rows past `heads` are zeros); with NORM each head
    RMS-normalized first (_head_rms_norm, weight norm_w_ptr); with ROT (rotary_tables' ROT tables) x1's leading
    ROT dims rotated in their pairs, the rest of x1 and x2 as they are. The one copy of the math, so every kernel
    that rotates (here, the fused decode attention) rounds to the same bits."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    live = h < heads
    src = src_row + h * stride_h + d
    x1_raw = tl.load(src, mask=live, other=0.0)
    x1 = x1_raw.to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, norm_w_ptr, eps, x1_raw.dtype, HALF)
    if ROT:  # x1 * cos - partner * sin on a pair's first element, + on its second (the sign is in `sin`)
        return (x1 * cos + _swap_pairs(x1, ROT) * sin).to(x1_raw.dtype), x2.to(x1_raw.dtype)
    return (x1 * cos - x2 * sin).to(x1_raw.dtype), (x2 * cos + x1 * sin).to(x1_raw.dtype)


@triton.jit
def _rotate_heads(src_row, dst_row, stride_h, heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  inv_scale=1.0, norm_w_ptr=None, eps=0.0, NORM: tl.constexpr = False, ROT: tl.constexpr = 0):
    """Rotates `heads` heads at src_row (head stride stride_h) into dst_row (heads contiguous; a cache row:
    see to_cache); with NORM RMS-normalized per head first."""
    r1, r2 = _rotated_halves(src_row, stride_h, heads, cos, sin, HALF, BLOCK_H, norm_w_ptr, eps, NORM, ROT)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    live = h < heads
    dst = dst_row + h * 2 * HALF + d
    tl.store(dst, to_cache(r1, dst_row, inv_scale), mask=live)
    tl.store(dst + HALF, to_cache(r2, dst_row, inv_scale), mask=live)


@triton.jit
def rotated_heads(src_row, stride_h, heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  ROT: tl.constexpr = 0):
    """The rotated heads as one register tile [BLOCK_H, 2 * HALF] (the halves side by side)."""
    r1, r2 = _rotated_halves(src_row, stride_h, heads, cos, sin, HALF, BLOCK_H, ROT=ROT)
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_H, 2 * HALF))


@triton.jit
def store_rotated_kv(k_row, v_row, kc_row, vc_row, stride_kh, stride_vh, heads, cos, sin, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, k_inv, v_inv, k_norm_ptr=None, eps=0.0, NORM: tl.constexpr = False,
                     ROT: tl.constexpr = 0):
    """A token's `heads` k heads rotated (NORM: RMS-normalized first) and its v heads as they are, into one
    cache slot (kc_row / vc_row: its first head; heads contiguous; k_inv / v_inv: see to_cache)."""
    _rotate_heads(k_row, kc_row, stride_kh, heads, cos, sin, HALF, BLOCK_H, k_inv, k_norm_ptr, eps, NORM, ROT)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, 2 * HALF)[None, :]
    live = h < heads
    v = tl.load(v_row + h * stride_vh + d, mask=live)
    tl.store(vc_row + h * 2 * HALF + d, to_cache(v, vc_row, v_inv), mask=live)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                  stride_kh, q_heads, k_heads, v_ptr, v_out_ptr, slot_ptr, stride_vt, stride_vh, stride_cs,
                  k_inv, v_inv, q_norm_ptr, k_norm_ptr, eps, HALF: tl.constexpr, BLOCK_QH: tl.constexpr,
                  BLOCK_KH: tl.constexpr, STORE_KV: tl.constexpr, NORM: tl.constexpr = False,
                  PDL: tl.constexpr = False, ROT: tl.constexpr = 0):
    """Grid [T, cdiv(q_heads, BLOCK_QH) + 1]. k_out / v_out: [T, Hkv, D] outputs, or (STORE_KV) the k / v
    caches [blocks, block_size, Hkv, D] with slot stride stride_cs, written at slot_ptr[t] (-1: a padding token, nothing written), an fp8
    cache times k_inv / v_inv (to_cache). NORM: q and k heads RMS-normalized first (Qwen3's q_norm /
    k_norm weights, eps): two launches fewer per layer."""
    pdl_handoff(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # BLOCK_QH q heads per program, then one program for k (and v): at decode the
    q_parts = tl.cdiv(q_heads, BLOCK_QH)  # few tokens' heads are spread over several SMs, not one
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos, sin = rotary_tables(cos_ptr, sin_ptr, pos, HALF, ROT)
    if part < q_parts:
        first = part * BLOCK_QH
        _rotate_heads(q_ptr + t * stride_qt + first * stride_qh, q_out_ptr + (t * q_heads + first) * 2 * HALF,
                      stride_qh, tl.minimum(q_heads - first, BLOCK_QH), cos, sin, HALF, BLOCK_QH, 1.0, q_norm_ptr,
                      eps, NORM, ROT)
    elif STORE_KV:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            row = slot.to(tl.int64) * stride_cs
            store_rotated_kv(k_ptr + t * stride_kt, v_ptr + t * stride_vt, k_out_ptr + row, v_out_ptr + row,
                             stride_kh, stride_vh, k_heads, cos, sin, HALF, BLOCK_KH, k_inv, v_inv, k_norm_ptr, eps,
                             NORM, ROT)
    else:
        _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * k_heads * 2 * HALF, stride_kh, k_heads, cos, sin, HALF,
                      BLOCK_KH, 1.0, k_norm_ptr, eps, NORM, ROT)
