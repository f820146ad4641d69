"""Triton decode attention over the paged KV cache (CUDA; also runs under TRITON_INTERPRET=1 on the CPU),
and the helpers it shares with the prefill kernel (attention_prefill.py: `store_kv_cache`,
`paged_prefill_attention`).

- The cache is the model's dtype or fp8 e4m3 (CacheConfig.kv_cache_dtype): stores round and saturate
  (`to_cache`), the attention kernels widen what they load to the dots' dtype (`_dots_in_fp16`: fp16 over an
  fp8 cache for 16-bit models); the decode kernel loads an fp8 V tile as 32-bit words and widens them in
  registers (`_v_in_words`).
- `paged_decode_attention`: one new token per sequence, split-KV ("flash decoding"): one program per
  (sequence, kv head, split) computes all q heads of its GQA group in one tile, so each K/V element is
  read once; a second kernel (`attention_merge`) merges the splits by their log-sum-exp (and, for a W4A8
  o_proj, quantizes the merged rows to fp8 in the same launch: one program per (sequence, head) agreeing
  on the row's scale through a spin barrier while batch * heads fits on the GPU, else one program per sequence;
  at batch 64 of the 8B that saved ~0.2 ms per step against a merge then a quantize launch).
  The split count is a launch constant, each split's range is derived from context_lens on the
  device: CUDA-graph safe.
  With `rotary` the split kernel also does the rotary embedding and the new token's KV store (what
  RotaryEmbedding.rotate_and_store does at prefill), so a decode layer's attention is two launches.
- gpt-oss's options (constexpr switches, off by default): attention sinks, a per-head logit in each
  row's denominator, fold into the decode merge; a sliding window narrows the decode splits to the new
  token's window, and Llama 4's chunked attention to the new token's chunk.
The torch references are `radiance.layers.attention.paged_attention_torch` / `store_kv_cache_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff
from radiance.kernels._triton.rotary import partial_width, rotary_tables, rotated_heads, rotates, store_rotated_kv
from radiance.kernels.activation import quantize_activations
from radiance.kernels.device_info import large_shared_memory, sm_count, supports_pdl
from radiance.layers.attention import UNIT_SCALES, KvScales
from radiance.layers.attention_merge import (LOG2E, ROWS_MAX_SPLITS, merge_quant_barrier, merge_quant_rows,
                                             merge_quant_serves, merge_splits)

_LOG2E = LOG2E.value


def _dots_in_fp16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Over an fp8 cache, a 16-bit model's attention dots run in fp16: e4m3 widens to fp16 in one instruction
    per pair but to bf16 only through fp32, and fp16 holds every e4m3 value and q's range; fp32 models
    keep fp32 dots (the exact reference path)."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32


def _v_in_words(q: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel reads an fp8 V tile as int32 words of 4 bytes and widens them in
    registers (`_load_widened`). Loaded as bytes and widened, V (the second dot's operand, whose rows
    run along the dot's K) streamed at 1.6-2.2 TB/s on the H200 against 2.0-2.8 as words: the decode
    kernel -10% at batch 1, -20 to -35% at batch 8-64; the prefill kernel was 5-9% slower with words,
    so it keeps bytes (bench/RESULTS.md, twenty-first session). Words need 4-byte aligned rows."""
    return (_dots_in_fp16(q, v_cache) and v_cache.shape[-1] % 4 == 0 and v_cache.data_ptr() % 4 == 0
            and all(stride % 4 == 0 for stride in v_cache.stride()[:-1]))


# $0: fp16 pair of bytes 0, 1 of the word $2; $1: of bytes 2, 3
_WIDEN_E4M3_ASM = tl.constexpr("""
{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}
""")


@triton.jit
def _fp16_half(pair, SHIFT: tl.constexpr):
    return ((pair >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_byte_fp16(words, J: tl.constexpr):
    return ((words >> (8 * J)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _load_widened(C, row, offs_d, kv_mask, mask_n, dtype, HEAD_DIM: tl.constexpr, WORDS: tl.constexpr,
                  ASM: tl.constexpr, EVICT: tl.constexpr):
    """Cache rows [BLOCK_N, D_PAD] at element offsets `row`, widened to `dtype`. With WORDS (an fp8
    cache, _v_in_words) as int32 words [BLOCK_N, D_PAD / 4], each widened to four fp16 in registers
    (inline asm on the GPU, the same values by bit arithmetic under the interpreter)."""
    if WORDS:
        offs_w = tl.arange(0, offs_d.shape[0] // 4)
        words = tl.load(C.to(tl.pointer_type(tl.int32), bitcast=True) + (row // 4)[:, None] + offs_w[None, :],
                        mask=mask_n[:, None] & (offs_w < HEAD_DIM // 4)[None, :], other=0, eviction_policy=EVICT)
        if ASM:
            lo, hi = tl.inline_asm_elementwise(_WIDEN_E4M3_ASM, "=r,=r,r", [words], dtype=(tl.int32, tl.int32),
                                               is_pure=True, pack=1)
            e0, e1, e2, e3 = _fp16_half(lo, 0), _fp16_half(lo, 16), _fp16_half(hi, 0), _fp16_half(hi, 16)
        else:
            e0, e1 = _e4m3_byte_fp16(words, 0), _e4m3_byte_fp16(words, 1)
            e2, e3 = _e4m3_byte_fp16(words, 2), _e4m3_byte_fp16(words, 3)
        # join appends the new axis last: [.., i, j] = byte 2i + j
        return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (row.shape[0], offs_d.shape[0]))
    else:
        return tl.load(C + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0, eviction_policy=EVICT).to(dtype)


@dataclass(frozen=True)
class DecodeTiling:
    """Launch shape of the split-KV decode kernel: cache rows per loop step, warps, pipeline depth; and,
    with long_block_n, a second loop of long_block_n rows per step (long_stages deep; 0: num_stages)
    that a split takes at run time when its share of the context is at least long_from tokens
    (graph-safe: the branch reads context_lens)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    long_block_n: int = 0
    long_from: int = 0
    long_stages: int = 0


def decode_tiling(head_dim: int, programs: int, sms: int, fp8_cache: bool = False,
                  large_smem: bool = True) -> DecodeTiling:
    """The decode kernel's tiling for `programs` (sequences x kv heads x splits) on `sms` SMs. While the
    programs fit two per SM (batch 1, where the splits carry the parallelism) a split over 512 tokens or
    more steps 128 rows at a time: the 8B's decode step at 32k context -3.9% (bf16 cache) / -5% (fp8),
    +0.5% at short context (128 rows at every context cost 1-1.5% there). Larger grids keep 64 rows, whose smaller
    tiles fit more programs per SM (bench/RESULTS.md, twentieth session).
    An fp8 cache read as words (_v_in_words) moves half the bytes per row: 128-row steps, three deep,
    pay from 256 tokens per split and up to three programs per SM (twenty-first session).
    128-row steps need Hopper's shared memory (`large_smem`); elsewhere (Ada: 99 KiB) 64 rows."""
    if head_dim > 128:
        return DecodeTiling(block_n=32)
    if not large_smem:
        return DecodeTiling(block_n=64)
    if fp8_cache and programs <= 3 * sms:
        return DecodeTiling(block_n=64, long_block_n=128, long_from=256, long_stages=3)
    if programs <= 2 * sms:
        return DecodeTiling(block_n=64, long_block_n=128, long_from=512)
    return DecodeTiling(block_n=64)


def _precision(q: torch.Tensor) -> str:
    # fp32 models get exact fp32 dots (the reference-quality path), not tf32
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _span(tokens: int | None, name: str) -> int:
    """A kernel constant in tokens (WINDOW, CHUNK): 0 for None (full causal attention), else at least 1."""
    if tokens is None:
        return 0
    if tokens < 1:
        raise ValueError(f"{name} must be at least 1 token, got {tokens}")
    return tokens


def _window(sliding_window: int | None) -> int:
    return _span(sliding_window, "sliding_window")


def _chunk(attention_chunk: int | None) -> int:
    return _span(attention_chunk, "attention_chunk")


def softcap_argument(softcap: float | None) -> float:
    """The kernels' soft cap in their scores' base-2 units (0: none): Gemma 2's cap * tanh(logit / cap) is, on
    logits times log2(e), cap' * tanh(s / cap') with cap' = cap * log2(e)."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"the attention soft cap must be positive, got {softcap}")
    return float(softcap) * _LOG2E


@triton.jit
def soft_capped(s, cap):
    """cap * tanh(s / cap), tanh as 1 - 2 / (e^2x + 1) (exp2: no libdevice call, the interpreter runs it too)."""
    return cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E / cap)) + 1.0))


@triton.jit
def _attend_rows(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, end,
                 stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
                 HEAD_DIM: tl.constexpr, V_WORDS: tl.constexpr, ASM: tl.constexpr, softcap=0.0,
                 SOFTCAP: tl.constexpr = False):
    """Online softmax of q's heads over cache rows [start, end) of sequence b, BLOCK_N rows a step,
    loads pipelined STAGES deep; with SOFTCAP the scores soft-capped at `softcap` (base-2 units) first."""
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0,
                    eviction_policy="evict_first").to(q.dtype)  # an fp8 cache is widened here
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = soft_capped(s, softcap)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_widened(VC, row, offs_d, kv_mask, mask_n, q.dtype, HEAD_DIM, V_WORDS, ASM, "evict_first")
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
                         LONG_FROM: tl.constexpr = 0, STAGES: tl.constexpr = 2, LONG_STAGES: tl.constexpr = 2,
                         V_WORDS: tl.constexpr = False, ASM: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                         softcap=0.0, SOFTCAP: tl.constexpr = False, CHUNK: tl.constexpr = 0,
                         ROT: tl.constexpr = 0):
    """With ROTARY, Q is unrotated and the new token's unrotated k and its v (KN, VN [B, Hkv, D]) are
    not in the cache yet: this launch does what rotary_kernel with STORE_KV would have done first.
    WINDOW > 0: the splits share only the window's last WINDOW tokens (the new one's keys), 0: all.
    CHUNK > 0: only the new token's chunk of CHUNK tokens, from ((kv_len - 1) // CHUNK) * CHUNK.
    SOFTCAP: the scores soft-capped at `softcap` (Gemma 2; softcap_argument)."""
    pdl_handoff(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(context_lens + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(kv_len - WINDOW, 0)
    if CHUNK > 0:  # (a padding row's kv_len is 0: clamped, not divided below zero)
        first = tl.maximum(first, tl.maximum(kv_len - 1, 0) // CHUNK * CHUNK)
    share = tl.cdiv(kv_len - first, SPLITS)
    step = BLOCK_N
    if LONG_BLOCK_N > 0 and share >= LONG_FROM:
        step = LONG_BLOCK_N
    per_split = tl.cdiv(share, step) * step
    start = first + split * per_split
    end = tl.minimum(start + per_split, kv_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    if ROTARY:
        HALF: tl.constexpr = HEAD_DIM // 2
        pos = tl.load(POS + b).to(tl.int64)
        cos, sin = rotary_tables(COS, SIN, pos, HALF, ROT)
        # the new token is the context's last (kv_len - 1): the one split holding it stores its k and v
        # (slot -1: a padding row, nothing) and only then reads the cache; the barrier orders this
        # CTA's global stores before its loads (__syncthreads). The other splits never read that slot.
        slot = tl.load(SLOTS + b)
        if (slot >= 0) & (start <= kv_len - 1) & (kv_len - 1 < end):
            store_rotated_kv(KN + b * stride_knb + kvh * stride_knh, VN + b * stride_vnb + kvh * stride_vnh,
                             KC + slot * stride_cs + kvh * stride_ch, VC + slot * stride_cs + kvh * stride_ch,
                             stride_knh, stride_vnh, 1, cos, sin, HALF, 1, k_inv, v_inv, ROT=ROT)
        tl.debug_barrier()
        q = rotated_heads(Q + b * stride_qb + kvh * GROUP * stride_qh, stride_qh, GROUP, cos, sin, HALF, G_PAD,
                          ROT)
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
                                     LONG_BLOCK_N, LONG_STAGES, PRECISION, HEAD_DIM, V_WORDS, ASM, softcap, SOFTCAP)
    else:
        m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, end,
                                     stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d, PAGE,
                                     BLOCK_N, STAGES, PRECISION, HEAD_DIM, V_WORDS, ASM, softcap, SOFTCAP)
    empty = l_i == 0.0  # a split past the context (or a padding row of a graph bucket)
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * v_scale  # (merging the splits commutes with v_scale)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :], out,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int, quantize: bool = False,
                           rotary: tuple | None = None, tiling: DecodeTiling | None = None,
                           kv_scales: KvScales = UNIT_SCALES, sinks: torch.Tensor | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           attention_chunk: int | None = None):
    """q [B, Hq, D] (one new token per sequence) -> [B, Hq, D]; with `quantize`, (x_q e4m3 [B, Hq * D],
    x_scale fp32 [B, 1]) for a W4A8 linear instead, the bytes of quantize_activations of that output,
    from the merge launch (attention_merge: the barrier kernel while merge_quant_serves, else the per-row
    kernel up to ROWS_MAX_SPLITS splits, else a merge launch and a quantize launch).

    rotary = (cos, sin, positions, k, v, slot_mapping) (RotaryEmbedding's fp32 tables [P, D/2], the
    new tokens' positions [B], unrotated k and v [B, Hkv, D], their cache slots [B], -1 = padding):
    q is unrotated and the cache lacks the new tokens; the split kernel rotates q, and stores the
    rotated k and the v, as RotaryEmbedding.rotate_and_store would (one launch fewer).
    An fp8 cache holds K and V against `kv_scales` (stored divided, read back times them).
    sliding_window: the splits read only the new token's window (None: the whole context); attention_chunk:
    only its chunk (Llama 4; None: no chunks); sinks: fp32 [Hq] logits, added to each row's denominator by the
    merge; softcap: the logits' soft cap (Gemma 2)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    v_words = _v_in_words(q, v_cache)
    tiling = tiling or decode_tiling(dim, batch * kv_heads * num_splits, sm_count(q.device),
                                     fp8_cache=v_words, large_smem=large_shared_memory(q.device))
    d_pad = triton.next_power_of_2(dim)
    pdl = supports_pdl(q.device)  # each launch waits for the one before it (pdl_handoff)
    acc = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    if rotary is None:
        cos = sin = positions = k_new = v_new = slots = q  # unused
    else:
        cos, sin, positions, k_new, v_new, slots = rotary
        if dim != d_pad or cos.dtype != torch.float32 or not rotates(dim, 2 * cos.shape[-1]):
            raise ValueError(f"rotary decode: the head size must be a power of 2 ({dim}), the tables fp32 "
                             f"({cos.dtype}) and as wide as half a head, or a power-of-2 part of a quarter "
                             f"({cos.shape[-1]})")
        q, k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_new, v_new))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, acc, lse, block_tables, context_lens, scale * kv_scales.k * _LOG2E, kv_scales.v,
        kv_scales.inv_k, kv_scales.inv_v,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        cos, sin, positions, k_new, v_new, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, D_PAD=d_pad,
        PAGE=k_cache.shape[1], SPLITS=num_splits, BLOCK_N=tiling.block_n, PRECISION=_precision(q),
        ROTARY=rotary is not None, ROT=partial_width(dim, 2 * cos.shape[-1]) if rotary is not None else 0,
        PDL=pdl, launch_pdl=pdl, DOTS_FP16=_dots_in_fp16(q, k_cache),
        LONG_BLOCK_N=tiling.long_block_n, LONG_FROM=tiling.long_from, STAGES=tiling.num_stages,
        LONG_STAGES=tiling.long_stages or tiling.num_stages, V_WORDS=v_words, ASM=q.is_cuda,
        WINDOW=_window(sliding_window), softcap=softcap_argument(softcap), SOFTCAP=softcap is not None,
        CHUNK=_chunk(attention_chunk), num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    if not quantize:
        return merge_splits(acc, lse, q.dtype, pdl, sinks=sinks)
    if merge_quant_serves(q):
        return merge_quant_barrier(acc, lse, q.dtype, pdl, sinks=sinks)
    if num_splits <= ROWS_MAX_SPLITS:
        return merge_quant_rows(acc, lse, q.dtype, pdl, sinks=sinks)
    return quantize_activations(merge_splits(acc, lse, q.dtype, pdl, sinks=sinks).reshape(batch, heads * dim))
