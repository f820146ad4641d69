"""Triton attention over the paged KV cache (CUDA; also runs under TRITON_INTERPRET=1 on the CPU).

- `store_kv_cache`: writes each new token's K/V at its cache slot (slot -1 = padding, skipped).
- The cache is the model's dtype or fp8 e4m3 (CacheConfig.kv_cache_dtype): stores round and saturate
  (`to_cache`), the attention kernels widen what they load to the dots' dtype (`_dots_in_fp16`: fp16 over an
  fp8 cache for 16-bit models).
- `paged_prefill_attention`: variable-length causal attention; sequence b's q rows are the last q_len of
  its context_lens[b] tokens, all read back from the paged cache (covers prefix-cache hits and chunked
  prefill). One program per (q tile, sequence, q head).
- `paged_decode_attention`: one new token per sequence, split-KV ("flash decoding"): one program per
  (sequence, kv head, split) computes all q heads of its GQA group in one tile, so each K/V element is
  read once; a second kernel merges the splits by their log-sum-exp (and, for a W4A8 o_proj, quantizes
  the merged rows to fp8 in the same launch: one program per (sequence, head) agreeing on the row's
  scale through a spin barrier while batch * heads fits on the GPU, else one program per sequence;
  at batch 64 of the 8B that saved ~0.2 ms per step against a merge then a quantize launch).
  The split count is a launch constant, each split's range is derived from context_lens on the
  device: CUDA-graph safe.
  With `rotary` the split kernel also does the rotary embedding and the new token's KV store (what
  RotaryEmbedding.rotate_and_store does at prefill), so a decode layer's attention is two launches.
The torch references are `radiance.layers.attention.paged_attention_torch` / `store_kv_cache_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import _row_scale, _to_e4m3, pdl_handoff, shared_row_scale
from radiance.kernels._triton.rotary import rotated_heads, store_rotated_kv, to_cache
from radiance.kernels.activation import fp8_outputs, quantize_activations, row_barrier_buffers
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.layers.attention import UNIT_SCALES, KvScales

_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _dots_in_fp16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Over an fp8 cache, a 16-bit model's attention dots run in fp16: e4m3 widens to fp16 in one instruction
    per pair but to bf16 only through fp32, and fp16 holds every e4m3 value and q's range; fp32 models
    keep fp32 dots (the exact reference path)."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32


@dataclass(frozen=True)
class DecodeTiling:
    """Launch shape of the split-KV decode kernel: cache rows per loop step, warps, pipeline depth; and,
    with long_block_n, a second loop of long_block_n rows per step that a split takes at run time when
    its share of the context is at least long_from tokens (graph-safe: the branch reads context_lens)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    long_block_n: int = 0
    long_from: int = 0


def decode_tiling(head_dim: int, programs: int, sms: int) -> DecodeTiling:
    """The decode kernel's tiling for `programs` (sequences x kv heads x splits) on `sms` SMs. While the
    programs fit two per SM (batch 1, where the splits carry the parallelism) a split over 512 tokens or
    more steps 128 rows at a time: the 8B's decode step at 32k context -2.6% (bf16 cache) / -5% (fp8),
    where 128 rows at every context cost 1-1.5% at short ones. Larger grids keep 64 rows, whose smaller
    tiles fit more programs per SM (bench/RESULTS.md, twentieth session)."""
    if head_dim > 128:
        return DecodeTiling(block_n=32)
    if programs <= 2 * sms:
        return DecodeTiling(block_n=64, long_block_n=128, long_from=512)
    return DecodeTiling(block_n=64)


def _precision(q: torch.Tensor) -> str:
    # fp32 models get exact fp32 dots (the reference-quality path), not tf32
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _store_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, stride_cs, k_inv, v_inv,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(K + t * stride_kt + offs, mask=mask)
        v = tl.load(V + t * stride_vt + offs, mask=mask)
        tl.store(KC + slot * stride_cs + offs, to_cache(k, KC, k_inv), mask=mask)
        tl.store(VC + slot * stride_cs + offs, to_cache(v, VC, v_inv), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, scales: KvScales = UNIT_SCALES) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [blocks, block_size, Hkv, D] at slot_mapping [T] (an fp8 cache
    against `scales`)."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    k = k.reshape(tokens, -1)
    v = v.reshape(tokens, -1)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    row = k.shape[1]
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(1),
                                scales.inv_k, scales.inv_v, ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _prefill_kernel(Q, KC, VC, O, tables, context_lens, cu_q, qk_scale, v_scale,
                    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh, stride_tb,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    DOTS_FP16: tl.constexpr = False):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_start
    if m_block * BLOCK_M < q_len:
        kv_len = tl.load(context_lens + b)
        before = kv_len - q_len  # cached tokens ahead of this step's queries
        kvh = h // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        mask_m = offs_m < q_len
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if DOTS_FP16:
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        q_pos = before + offs_m
        end = tl.minimum(kv_len, before + (m_block + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_len
            page = tl.load(tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0)
            row = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(KC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # fp8: widened
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            allowed = (q_pos[:, None] >= offs_n[None, :]) & mask_n[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None] * v_scale
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
                            scale: float, kv_scales: KvScales = UNIT_SCALES) -> torch.Tensor:
    """q [T, Hq, D] (sequences back to back) -> [T, Hq, D] (an fp8 cache read back times `kv_scales`)."""
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty_like(q)
    block_m = 64 if max_q_len > 32 else 16
    grid = (triton.cdiv(max_q_len, block_m), block_tables.shape[0], heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, scale * kv_scales.k * _LOG2E,
        kv_scales.v,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim), PAGE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=64 if dim <= 128 else 32, PRECISION=_precision(q),
        DOTS_FP16=_dots_in_fp16(q, k_cache), num_warps=4, num_stages=2)
    return out


@triton.jit
def _attend_rows(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, end,
                 stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of q's heads over cache rows [start, end) of sequence b, BLOCK_N rows a step."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0,
                    eviction_policy="evict_first").to(q.dtype)  # an fp8 cache is widened here
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0,
                    eviction_policy="evict_first").to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(Q, KC, VC, ACC, LSE, tables, context_lens, qk_scale, v_scale, k_inv, v_inv,
                         stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb,
                         stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                         COS, SIN, POS, KN, VN, SLOTS, stride_knb, stride_knh, stride_vnb, stride_vnh,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         PAGE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, ROTARY: tl.constexpr, PDL: tl.constexpr = False,
                         DOTS_FP16: tl.constexpr = False, LONG_BLOCK_N: tl.constexpr = 0,
                         LONG_FROM: tl.constexpr = 0):
    """With ROTARY, Q is unrotated and the new token's unrotated k and its v (KN, VN [B, Hkv, D]) are
    not in the cache yet: this launch does what rotary_kernel with STORE_KV would have done first."""
    pdl_handoff(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(context_lens + b)
    share = tl.cdiv(kv_len, SPLITS)
    step = BLOCK_N
    if LONG_BLOCK_N > 0 and share >= LONG_FROM:
        step = LONG_BLOCK_N
    per_split = tl.cdiv(share, step) * step
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        pos = tl.load(POS + b).to(tl.int64)
        cos = tl.load(COS + pos * HALF + tl.arange(0, HALF)[None, :])
        sin = tl.load(SIN + pos * HALF + tl.arange(0, HALF)[None, :])
        # the new token is the context's last (kv_len - 1): the one split holding it stores its k and v
        # (slot -1: a padding row, nothing) and only then reads the cache; the barrier orders this
        # CTA's global stores before its loads (__syncthreads). The other splits never read that slot.
        slot = tl.load(SLOTS + b)
        if (slot >= 0) & (start <= kv_len - 1) & (kv_len - 1 < end):
            store_rotated_kv(KN + b * stride_knb + kvh * stride_knh, VN + b * stride_vnb + kvh * stride_vnh,
                             KC + slot * stride_cs + kvh * stride_ch, VC + slot * stride_cs + kvh * stride_ch,
                             stride_knh, stride_vnh, 1, cos, sin, HALF, 1, k_inv, v_inv)
        tl.debug_barrier()
        q = rotated_heads(Q + b * stride_qb + kvh * GROUP * stride_qh, stride_qh, GROUP, cos, sin, HALF, G_PAD)
    else:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOTS_FP16:
        q = q.to(tl.float16)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if LONG_BLOCK_N > 0 and share >= LONG_FROM:
        m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, end,
                                     stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d, PAGE,
                                     LONG_BLOCK_N, PRECISION)
    else:
        m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, end,
                                     stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d, PAGE,
                                     BLOCK_N, PRECISION)
    empty = l_i == 0.0  # a split past the context (or a padding row of a graph bucket)
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * v_scale  # (merging the splits commutes with v_scale)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :], out,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _add_split(out, total, lse_ptrs, acc_ptrs, s, m, mask_h, mask, stride_as):
    w = tl.exp2(tl.load(lse_ptrs + s, mask=mask_h, other=float("-inf")) - m)
    return out + tl.load(acc_ptrs + s * stride_as, mask=mask, other=0.0) * w[:, None], total + w


@triton.jit
def _merge_heads(ACC, LSE, b, heads, num_heads, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                 SPLIT_GROUP: tl.constexpr):
    """Sequence b's q heads `heads` [H] (those >= num_heads masked off: zeros) merged, [H, D_PAD] fp32:
    each head's splits weighted by their log-sum-exp. The splits are added one after another in
    split order (not by tl.sum, whose order follows the layout, i.e. the tile and num_warps), so
    every merge kernel computes the same bits whatever its tile and SPLIT_GROUP: the splits are
    unrolled SPLIT_GROUP at a time (their loads in flight together) in a loop over the groups, so
    that registers hold ~SPLIT_GROUP tiles of partials however many splits there are."""
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_h = heads < num_heads
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse_ptrs = LSE + b * stride_lb + heads * stride_lh
    acc_ptrs = ACC + b * stride_ab + heads[:, None] * stride_ah + offs_d[None, :]
    lse = tl.load(lse_ptrs[:, None] + offs_s[None, :], mask=mask_h[:, None] & (offs_s < SPLITS)[None, :],
                  other=float("-inf"))
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (context 0): zeros, not NaN
    total = tl.zeros_like(m)
    out = tl.zeros([heads.shape[0], D_PAD], tl.float32)
    FULL: tl.constexpr = SPLITS - SPLITS % SPLIT_GROUP
    for s0 in range(0, FULL, SPLIT_GROUP):
        for j in tl.static_range(SPLIT_GROUP):
            out, total = _add_split(out, total, lse_ptrs, acc_ptrs, s0 + j, m, mask_h, mask, stride_as)
    for s in tl.static_range(FULL, SPLITS):
        out, total = _add_split(out, total, lse_ptrs, acc_ptrs, s, m, mask_h, mask, stride_as)
    return out / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_head(ACC, LSE, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    """One (sequence, q head)'s output [D_PAD] in fp32 (_merge_heads of that one head, all splits
    unrolled)."""
    one = h + tl.arange(0, 1)
    out = _merge_heads(ACC, LSE, b, one, h + 1, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                       HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLITS)
    return tl.reshape(out, [D_PAD])


@triton.jit
def _decode_merge_kernel(ACC, LSE, O, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_handoff(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    out = _merge_head(ACC, LSE, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                      HEAD_DIM, D_PAD, SPLITS, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _decode_merge_quant_kernel(ACC, LSE, XQ, XS, SLOTS, COUNT, stride_ab, stride_ah, stride_as, stride_lb,
                               stride_lh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                               S_PAD: tl.constexpr, H_PAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               PDL: tl.constexpr):
    """_decode_merge_kernel and the per-token fp8 quantization of its output row (all heads) in one
    launch, for the W4A8 o_proj: the heads of a sequence agree on the row's amax through a spin
    barrier (every program resident: the launcher keeps batch * heads within the SM count). The
    merged values are rounded to the model's dtype first, so the bytes equal merge-then-quantize."""
    pdl_handoff(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(0)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    y = _merge_head(ACC, LSE, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                    HEAD_DIM, D_PAD, SPLITS, S_PAD).to(OUT_DTYPE).to(tl.float32)
    local = tl.max(tl.where(mask_d, tl.abs(y), 0.0), axis=0)
    has_nan = tl.sum((y != y).to(tl.int32), axis=0) > 0
    scale = shared_row_scale(SLOTS, COUNT, b, h, local, has_nan, heads, H_PAD)
    tl.store(XQ + b * heads * HEAD_DIM + h * HEAD_DIM + offs_d, _to_e4m3(y, scale, False), mask=mask_d)
    if h == 0:
        tl.store(XS + b, scale)


@triton.jit
def _rounded_heads(ACC, LSE, b, heads, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                   HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                   S_PAD: tl.constexpr, SPLIT_GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """(_merge_heads rounded to the model's dtype, as fp32 [H, D_PAD]; the mask of its real elements)."""
    y = _merge_heads(ACC, LSE, b, heads, HEADS, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                     HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP).to(OUT_DTYPE).to(tl.float32)
    return y, (heads < HEADS)[:, None] & (tl.arange(0, D_PAD) < HEAD_DIM)[None, :]


@triton.jit
def _decode_merge_rows_quant_kernel(ACC, LSE, XQ, XS, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                                    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                                    SPLITS: tl.constexpr, S_PAD: tl.constexpr, SPLIT_GROUP: tl.constexpr,
                                    H_BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
                                    PDL: tl.constexpr):
    """_decode_merge_kernel then quantize_rows_kernel (per-token e4m3 of the row of all heads) in one
    launch, one program per sequence: no barrier, so any batch (and the interpreter). The merged
    values are rounded to the model's dtype first, so the bytes equal merge-then-quantize. A row of
    up to H_BLOCK heads stays in registers; a longer one takes two passes over H_BLOCK-head chunks
    (the amax, then the merge again, its partials from the cache, and the division)."""
    pdl_handoff(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, H_BLOCK)
    xq_row = XQ + b * (HEADS * HEAD_DIM) + tl.arange(0, D_PAD)[None, :]
    if H_BLOCK >= HEADS:
        y, mask = _rounded_heads(ACC, LSE, b, offs_h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                                 HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE)
        amax = tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), axis=0)
        nans = tl.sum(tl.sum(((y != y) & mask).to(tl.int32), axis=1), axis=0)
        scale = _row_scale(amax, nans > 0)
        tl.store(xq_row + offs_h[:, None] * HEAD_DIM, _to_e4m3(y, scale, INTERPRETER), mask=mask)
        tl.store(XS + b, scale)
    else:
        amax = tl.zeros([H_BLOCK, D_PAD], tl.float32)
        nans = tl.zeros([H_BLOCK, D_PAD], tl.int32)
        for h0 in range(0, HEADS, H_BLOCK):
            y, mask = _rounded_heads(ACC, LSE, b, h0 + offs_h, stride_ab, stride_ah, stride_as, stride_lb,
                                     stride_lh, HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(y), 0.0))
            nans += ((y != y) & mask).to(tl.int32)
        scale = _row_scale(tl.max(tl.max(amax, axis=1), axis=0), tl.sum(tl.sum(nans, axis=1), axis=0) > 0)
        for h0 in range(0, HEADS, H_BLOCK):
            y, mask = _rounded_heads(ACC, LSE, b, h0 + offs_h, stride_ab, stride_ah, stride_as, stride_lb,
                                     stride_lh, HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE)
            tl.store(xq_row + (h0 + offs_h)[:, None] * HEAD_DIM, _to_e4m3(y, scale, INTERPRETER), mask=mask)
        tl.store(XS + b, scale)


def _merge_quant_serves(q: torch.Tensor) -> bool:
    """Whether the barrier merge + quantize (_decode_merge_quant_kernel) runs: it needs every program
    of a row resident at once (CUDA only: the interpreter runs programs one by one, so its barrier
    would never open). Otherwise _decode_merge_rows_quant_kernel does (see ROWS_MAX_SPLITS)."""
    return q.is_cuda and q.shape[0] * q.shape[1] <= sm_count(q.device)


# the per-row merge + quantize serves up to this many splits: one program merges heads x splits
# partials, so a few sequences with many splits (batch 3 of a 64-head model: 11) would leave most SMs
# idle; there the merge (a program per head) and quantize_activations run as two launches
ROWS_MAX_SPLITS = 4

# merged values one program of _decode_merge_rows_quant_kernel holds at once (fp32, 16 a thread at 16
# warps): rows up to this wide (64 heads x 128) in one pass, wider ones in two over chunks of heads
_ROW_TILE = 8192


def _s_pad(splits: int) -> int:
    return max(2, triton.next_power_of_2(splits))


def _merge(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """The split partials acc [B, Hq, S, D] / lse [B, Hq, S] merged: [B, Hq, D] in `dtype`."""
    batch, heads, splits, dim = acc.shape
    out = torch.empty((batch, heads, dim), dtype=dtype, device=acc.device)
    _decode_merge_kernel[(batch, heads)](
        acc, lse, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim), SPLITS=splits,
        S_PAD=_s_pad(splits), PDL=pdl, launch_pdl=pdl, num_warps=1)
    return out


def _merge_quant_barrier(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(_merge(acc, lse, dtype)) in one launch of batch * heads programs (CUDA,
    all resident: _merge_quant_serves)."""
    batch, heads, splits, dim = acc.shape
    x_q, x_scale = fp8_outputs(batch, heads * dim, acc.device)
    slots, count = row_barrier_buffers(acc.device, batch, heads)
    _decode_merge_quant_kernel[(heads, batch)](
        acc, lse, x_q, x_scale, slots, count, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
        lse.stride(1), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim), SPLITS=splits, S_PAD=_s_pad(splits),
        H_PAD=max(2, triton.next_power_of_2(heads)), OUT_DTYPE=_TL_DTYPES[dtype],
        PDL=pdl, launch_pdl=pdl, num_warps=1)
    return x_q, x_scale


def _merge_quant_rows(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False,
                      tile: int = _ROW_TILE, split_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(_merge(acc, lse, dtype)) in one launch of one program per sequence
    (`tile`, `split_group`: see _ROW_TILE and _merge_heads; the tests vary them)."""
    batch, heads, splits, dim = acc.shape
    d_pad = triton.next_power_of_2(dim)
    h_block = min(triton.next_power_of_2(heads), max(1, tile // d_pad))
    warps = max(1, min(16, h_block * d_pad // 512))
    # splits unrolled at a time: ~64 registers a thread of partials in flight (all of them unrolled,
    # the compiler hoists every load: 64 heads x 11 splits spilled at 16 warps)
    per_thread = max(1, h_block * d_pad // (32 * warps))
    x_q, x_scale = fp8_outputs(batch, heads * dim, acc.device)
    _decode_merge_rows_quant_kernel[(batch,)](
        acc, lse, x_q, x_scale, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        HEADS=heads, HEAD_DIM=dim, D_PAD=d_pad, SPLITS=splits, S_PAD=_s_pad(splits),
        SPLIT_GROUP=split_group or max(1, min(splits, 64 // per_thread)), H_BLOCK=h_block, OUT_DTYPE=_TL_DTYPES[dtype],
        INTERPRETER=not acc.is_cuda, PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return x_q, x_scale


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int, quantize: bool = False,
                           rotary: tuple | None = None, tiling: DecodeTiling | None = None,
                           kv_scales: KvScales = UNIT_SCALES):
    """q [B, Hq, D] (one new token per sequence) -> [B, Hq, D]; with `quantize`, (x_q e4m3 [B, Hq * D],
    x_scale fp32 [B, 1]) for a W4A8 linear instead, the bytes of quantize_activations of that output,
    from the merge launch (the barrier kernel while _merge_quant_serves, else the per-row kernel up
    to ROWS_MAX_SPLITS splits, else a merge launch and a quantize launch).

    rotary = (cos, sin, positions, k, v, slot_mapping) (RotaryEmbedding's fp32 tables [P, D/2], the
    new tokens' positions [B], unrotated k and v [B, Hkv, D], their cache slots [B], -1 = padding):
    q is unrotated and the cache lacks the new tokens; the split kernel rotates q, and stores the
    rotated k and the v, as RotaryEmbedding.rotate_and_store would (one launch fewer).
    An fp8 cache holds K and V against `kv_scales` (stored divided, read back times them)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    tiling = tiling or decode_tiling(dim, batch * kv_heads * num_splits, sm_count(q.device))
    d_pad = triton.next_power_of_2(dim)
    pdl = supports_pdl(q.device)  # each launch waits for the one before it (pdl_handoff)
    acc = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    if rotary is None:
        cos = sin = positions = k_new = v_new = slots = q  # unused
    else:
        cos, sin, positions, k_new, v_new, slots = rotary
        assert dim == d_pad and cos.dtype == torch.float32, "rotary decode: D a power of 2, fp32 tables"
        q, k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_new, v_new))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, acc, lse, block_tables, context_lens, scale * kv_scales.k * _LOG2E, kv_scales.v,
        kv_scales.inv_k, kv_scales.inv_v,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        cos, sin, positions, k_new, v_new, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, D_PAD=d_pad,
        PAGE=k_cache.shape[1], SPLITS=num_splits, BLOCK_N=tiling.block_n, PRECISION=_precision(q),
        ROTARY=rotary is not None, PDL=pdl, launch_pdl=pdl, DOTS_FP16=_dots_in_fp16(q, k_cache),
        LONG_BLOCK_N=tiling.long_block_n, LONG_FROM=tiling.long_from,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    if not quantize:
        return _merge(acc, lse, q.dtype, pdl)
    if _merge_quant_serves(q):
        return _merge_quant_barrier(acc, lse, q.dtype, pdl)
    if num_splits <= ROWS_MAX_SPLITS:
        return _merge_quant_rows(acc, lse, q.dtype, pdl)
    return quantize_activations(_merge(acc, lse, q.dtype, pdl).reshape(batch, heads * dim))
