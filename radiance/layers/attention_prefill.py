"""Triton prefill attention over the paged KV cache (CUDA; also runs under TRITON_INTERPRET=1 on the CPU).

- `store_kv_cache`: writes each new token's K/V at its cache slot (slot -1 = padding, skipped); an fp8 cache
  rounds and saturates (`to_cache`).
- `paged_prefill_attention`: variable-length causal attention; sequence b's q rows are the last q_len of
  its context_lens[b] tokens, all read back from the paged cache (covers prefix-cache hits and chunked
  prefill). One program per (q tile, sequence, q head); the cache tiles wholly below the q tile's first
  query run without the causal mask, only the diagonal ones mask (1.2x at 4k-8k tokens on the H200).
  gpt-oss's sinks fold into the final normalization; a sliding window masks every tile and skips those
  wholly below it; Llama 4's attention chunks skip the tiles below the chunk of the q tile's first query and
  mask only the tiles below the chunk start of its last query (a q tile across chunks) and the diagonal ones.
The decode kernels and the helpers both share are attention_triton.py's; the torch references are
`radiance.layers.attention.paged_attention_torch` / `store_kv_cache_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.rotary import to_cache
from radiance.kernels.device_info import large_shared_memory
from radiance.layers.attention import UNIT_SCALES, KvScales
from radiance.layers.attention_merge import LOG2E, sinks_argument
from radiance.layers.attention_triton import (_chunk, _dots_in_fp16, _precision, _window, soft_capped,
                                              softcap_argument)

_LOG2E = LOG2E.value


@dataclass(frozen=True)
class PrefillTiling:
    """Launch shape of the prefill kernel: q rows per program, cache rows per loop step, warps, pipeline depth."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def prefill_tiling(head_dim: int, max_q_len: int, max_kv_len: int, fp8_dots: bool,
                   large_smem: bool = True) -> PrefillTiling:
    """The prefill kernel's tiling. Measured on the H200 (8B layout; bench/RESULTS.md, twenty-first
    session): over an fp8 cache (fp16 dots) 128-row steps three deep are 7-12% faster at every context
    tried (up to 32k) and even at 2k fresh; over a 16-bit cache 128 q rows x 128 cache rows with 8 warps,
    three deep, are 3-5% faster once contexts reach 4k tokens, and ~10% slower below (2k fresh).
    The larger tiles need Hopper's shared memory."""
    block_n = 64 if head_dim <= 128 else 32
    if max_q_len <= 32:
        return PrefillTiling(block_m=16, block_n=block_n)
    if head_dim > 128 or not large_smem:
        return PrefillTiling(block_n=block_n)
    if fp8_dots:
        return PrefillTiling(block_n=128, num_stages=3)
    if max_kv_len >= 4096:
        return PrefillTiling(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return PrefillTiling()


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
def _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, start, stop, kv_len, q_pos,
                   stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
                   WINDOW: tl.constexpr, softcap, SOFTCAP: tl.constexpr, CHUNK: tl.constexpr = 0):
    """Online softmax of the q tile over cache rows [start, stop) of sequence b, BLOCK_N rows a step. MASKED:
    causal (and WINDOW, CHUNK) masks per row; otherwise every row sees every key (keys that every row of the
    tile sees). SOFTCAP: the scores soft-capped at `softcap` (base-2 units) first."""
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_len
        page = tl.load(tables + b * stride_tb + offs_n // PAGE, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # fp8: widened
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = soft_capped(s, softcap)
        if MASKED:
            allowed = (q_pos[:, None] >= offs_n[None, :]) & mask_n[None, :]
            if WINDOW > 0:
                allowed &= q_pos[:, None] - offs_n[None, :] < WINDOW
            if CHUNK > 0:  # keys from the start of the query's chunk
                allowed &= offs_n[None, :] >= (q_pos // CHUNK * CHUNK)[:, None]
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if MASKED and (WINDOW > 0 or CHUNK > 0):  # a row whose window / chunk starts past this tile: no key yet
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(Q, KC, VC, O, tables, context_lens, cu_q, qk_scale, v_scale, SINKS,
                    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh, stride_tb,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    DOTS_FP16: tl.constexpr = False, HAS_SINKS: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                    softcap=0.0, SOFTCAP: tl.constexpr = False, CHUNK: tl.constexpr = 0):
    """WINDOW > 0: a sliding window of that many tokens (0: full causal). CHUNK > 0: each query sees the keys
    of its chunk of CHUNK tokens up to itself (Llama 4; 0: none). HAS_SINKS: the per-head logit SINKS[h] joins
    each row's denominator. SOFTCAP: the scores soft-capped at `softcap` (Gemma 2)."""
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
        if WINDOW > 0:  # skip the tiles below the window of the tile's first query; mask every tile
            lo = tl.maximum(before + m_block * BLOCK_M - WINDOW + 1, 0)
            if CHUNK > 0:  # (both: the keys inside the two)
                lo = tl.maximum(lo, (before + m_block * BLOCK_M) // CHUNK * CHUNK)
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, lo // BLOCK_N * BLOCK_N,
                                           end, kv_len, q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d,
                                           mask_d, PAGE, BLOCK_N, PRECISION, True, WINDOW, softcap, SOFTCAP, CHUNK)
        elif CHUNK > 0:
            # skip the tiles below the chunk of the tile's first query; the keys from the chunk start of its last
            # real query (end - 1) up to its first query are seen by every row: unmasked there (whole tiles), as
            # below. Masked: what lies under that chunk start (rows of an earlier chunk) and the diagonal
            first_q = before + m_block * BLOCK_M
            lo = first_q // CHUNK * CHUNK // BLOCK_N * BLOCK_N
            full_end = (first_q + 1) // BLOCK_N * BLOCK_N
            full_lo = tl.minimum(tl.cdiv((end - 1) // CHUNK * CHUNK, BLOCK_N) * BLOCK_N, full_end)
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, lo, full_lo, kv_len,
                                           q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                                           PAGE, BLOCK_N, PRECISION, True, WINDOW, softcap, SOFTCAP, CHUNK)
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, full_lo, full_end,
                                           kv_len, q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                                           PAGE, BLOCK_N, PRECISION, False, WINDOW, softcap, SOFTCAP, CHUNK)
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, full_end, end,
                                           kv_len, q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                                           PAGE, BLOCK_N, PRECISION, True, WINDOW, softcap, SOFTCAP, CHUNK)
        else:
            # keys up to the tile's first query position are seen by every row: no causal mask there (the
            # compare-and-select costs the softmax's ALU on every tile otherwise); only the diagonal masks
            full_end = (before + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, 0, full_end, kv_len,
                                           q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                                           PAGE, BLOCK_N, PRECISION, False, WINDOW, softcap, SOFTCAP)
            m_i, l_i, acc = _prefill_tiles(q, m_i, l_i, acc, KC, VC, tables, qk_scale, b, kvh, full_end, end,
                                           kv_len, q_pos, stride_tb, stride_cb, stride_cs, stride_ch, offs_d, mask_d,
                                           PAGE, BLOCK_N, PRECISION, True, WINDOW, softcap, SOFTCAP)
        if WINDOW > 0 or CHUNK > 0:  # a padding row past q_len may have seen no key (0 / 0; never stored)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        if HAS_SINKS:  # the sink's share of the denominator, in the scores' base-2 units (no value)
            l_i += tl.exp2(tl.load(SINKS + h) * LOG2E - m_i)
        out = acc / l_i[:, None] * v_scale
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
                            scale: float, kv_scales: KvScales = UNIT_SCALES, max_kv_len: int | None = None,
                            tiling: PrefillTiling | None = None, sinks: torch.Tensor | None = None,
                            sliding_window: int | None = None, out: torch.Tensor | None = None,
                            softcap: float | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] (sequences back to back) -> [T, Hq, D] (an fp8 cache read back times `kv_scales`).
    max_kv_len: the longest context (host side; None = the kernel's default tiling for short ones).
    sinks: fp32 [Hq] logits in each row's denominator; sliding_window: tokens each query sees (None: all);
    attention_chunk C: the query at position p sees keys (p // C) * C <= j <= p only (Llama 4; None: no chunks).
    out: where to write the result (like q; rows past cu_seqlens_q[-1] are left as they are); softcap: the logits'
    soft cap (Gemma 2), None for none."""
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    dots_fp16 = _dots_in_fp16(q, k_cache)
    tiling = tiling or prefill_tiling(dim, max_q_len, max_kv_len or 0, dots_fp16, large_shared_memory(q.device))
    grid = (triton.cdiv(max_q_len, tiling.block_m), block_tables.shape[0], heads)
    # no shortcut to the causal kernel where max_kv_len fits in a chunk: a prefill graph captured at a short
    # context replays for longer ones (step_graphs.PrefillGraphs), so the chunk mask must be compiled in
    chunk = _chunk(attention_chunk)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, scale * kv_scales.k * _LOG2E,
        kv_scales.v, sinks_argument(sinks, heads, q),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim), PAGE=k_cache.shape[1],
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, PRECISION=_precision(q),
        DOTS_FP16=dots_fp16, HAS_SINKS=sinks is not None, WINDOW=_window(sliding_window),
        softcap=softcap_argument(softcap), SOFTCAP=softcap is not None, CHUNK=chunk,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return out
