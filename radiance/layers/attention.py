"""Attention over a paged KV cache.

One `AttentionMetadata` describes a step's flattened, variable-length batch: sequence i owns query rows
cu_seqlens_q[i]:cu_seqlens_q[i+1] (its new tokens) and attends to context_lens[i] cached tokens, the
last q_len of which are the new ones (written to the cache first, at `slot_mapping`). On CUDA the Triton
kernels of `attention_triton` run; on the CPU (and as the reference) torch SDPA over gathered blocks.
Without metadata (`meta=None`) attention is plain causal over the given [B, T] batch, no cache.

Two options of gpt-oss, on every path: `sinks` (a learned logit per q head that joins each query's
softmax denominator and contributes no value; unscaled, as HF's eager attention appends it) and a
layer's `sliding_window` W (the query at position p sees the keys at p - W < j <= p; the cache keeps
every token, the kernels skip what lies outside the window). Llama 4's chunked local attention, a layer's
`attention_chunk` C: the query at position p sees the keys of its own chunk up to itself, (p // C) * C <= j <= p
(a window that starts at the chunk's start; one kind of local attention per layer). Gemma 2's `softcap` c:
each scaled logit x becomes c * tanh(x / c) before the mask and the softmax.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radiance.formats.fp8 import FP8_E4M3_MAX
from radiance.kernels.activation import Fp8Activations


class StateSave(NamedTuple):
    seq: int
    tokens: int
    row: int
    chunk: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64 cache slot (block * block_size + offset) of each new token; -1 = skip
    block_tables: torch.Tensor   # [B, max_blocks] int32
    context_lens: torch.Tensor   # [B] int32, tokens in the cache after this step
    cu_seqlens_q: torch.Tensor   # [B + 1] int32
    q_lens: list[int]            # host copies (the CPU path and launch grids)
    kv_lens: list[int]
    is_decode: bool              # every sequence has exactly one new token
    decode_splits: int = 1       # KV partitions per sequence of the decode kernel (fixed per graph bucket)
    slots_valid: bool = False    # no -1 in slot_mapping (known on the host): the torch store skips its check
    # per sequence, the first cache block of its context when its blocks run in order (b, b + 1, ...),
    # else -1: the torch path then reads the cache in place instead of gathering it (None: always gather)
    kv_first_blocks: list[int] | None = None
    # a CUDA graph's count of real rows (device int, element 0): the rows after it pad the step to its bucket,
    # and the sparse MoE layers route them to no expert (None: every row is real)
    valid_rows: torch.Tensor | None = None
    # the metadata of KV groups 1, 2, ... (engine.kv_layout): the same step, their own slots, tables and first
    # blocks; a layer of group g reads `of_group(g)`
    other_groups: tuple[AttentionMetadata, ...] = ()
    # a hybrid model's linear-attention layers (engine.state_cache): each sequence's state slot (device int64 [B]) and
    # whether it continues the state there (host; False: its first tokens, the slot's old contents are not read)
    state_slots: torch.Tensor | None = None
    continues_state: list[bool] | None = None
    continues_state_device: torch.Tensor | None = None  # the same flags, int32 [B], for the CUDA prefill kernel
    # a CUDA prefill step the chunked delta rule serves: its chunk table (gated_delta_chunked.serving_chunks),
    # built once for every linear-attention layer; None: the token-by-token kernel
    delta_chunks: object | None = None
    # the states a prefix cache keeps from inside this step (engine.state_cache.PrefixStates): per save, the
    # sequence's index, the tokens into its step (a whole number of the delta rule's 64-token chunks), the row
    # they go to, and that chunk's index in delta_chunks' table
    state_saves: tuple[StateSave, ...] = ()

    def of_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.other_groups[group - 1]


@dataclass(frozen=True)
class KvScales:
    """Calibrated scales of an fp8 KV cache (a checkpoint's per-layer k_scale / v_scale): the cache stores
    K / k and V / v, saturating at +-448, and attention reads them back times k and v (folded into the
    softmax scale and the output). 1.0 for a cache of the model's dtype, or when the checkpoint has none."""

    k: float = 1.0
    v: float = 1.0
    inv_k: float = field(init=False, repr=False, compare=False)  # what the stores multiply by
    inv_v: float = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "inv_k", _fp32_inverse(self.k))
        object.__setattr__(self, "inv_v", _fp32_inverse(self.v))


def _fp32_inverse(scale: float) -> float:
    # the float32 the Triton stores multiply by, so the torch and Triton stores round the same products
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


UNIT_SCALES = KvScales()


# decode batches from which the split kernel rotates q and stores K/V itself. On the H200 (8B, MXFP4,
# context 128) the fused launch saved 66 us per step at batch 64 but cost 21 us at batch 1, where
# each split program's longer start (positions, tables, rotation, barrier) is on the critical path
# (bench/RESULTS.md, sixth session); 16 lies between the two measured points
FUSED_ROTARY_MIN_BATCH = 16


def _head_norms(q: torch.Tensor, k: torch.Tensor, qk_norm: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (qk_norm[0](q), qk_norm[1](k)) if qk_norm is not None else (q, k)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, attention_chunk: int | None = None):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        if attention_chunk is not None and attention_chunk < 1:
            raise ValueError(f"attention_chunk must be at least 1 token, got {attention_chunk}")
        if sliding_window is not None and attention_chunk is not None:
            raise ValueError(f"a layer attends either within a sliding window ({sliding_window}) or within "
                             f"chunks ({attention_chunk}), not both")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"the attention soft cap must be positive, got {softcap}")
        self.softcap = softcap  # None: the logits as they are
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.sliding_window = sliding_window  # None: full causal attention
        self.attention_chunk = attention_chunk  # None: no chunks (Llama 4's chunked layers: 8192)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # its KV group (engine.kv_layout): which block tables and slots of a step it reads
        # without a cache (evaluation), K/V are rounded to this dtype first, as a cache of it would store them
        self.kv_storage_dtype: torch.dtype | None = None
        self.fp8_kv_scales = UNIT_SCALES  # what an fp8 cache of this layer stores against (the checkpoint's)
        # set while a piecewise CUDA graph is captured (engine.piecewise_graphs.PiecewiseCapture): the
        # prefill attention launch is handed to it, to run eagerly between the captured pieces
        self.cut = None

    def kv_scales(self, cache_dtype: torch.dtype | None) -> KvScales:
        """The scales a cache of `cache_dtype` stores K/V against: the calibrated ones for fp8."""
        return self.fp8_kv_scales if cache_dtype == torch.float8_e4m3fn else UNIT_SCALES

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None,
                rotary: tuple | None = None, quantize: bool = False, qk_norm: tuple | None = None,
                sinks: torch.Tensor | None = None):
        """q [..., Hq, D], k/v [..., Hkv, D] -> [..., Hq * D]. rotary = (RotaryEmbedding, positions)
        rotates q and k first; on the Triton path that launch also writes k and v to the cache (at
        decode the attention kernel itself rotates and writes them).
        qk_norm = (q_norm, k_norm) RMSNorm modules normalize each head of q and k before the rotation
        (Qwen3): inside the rotary launch where it writes the cache, as separate launches elsewhere.
        `quantize` (the next linear runs W4A8) lets the decode path return Fp8Activations, quantized
        in its merge launch; every other path returns the tensor and leaves quantization to the linear.
        sinks: fp32 [num_heads] logits that join each row's softmax denominator (gpt-oss), or None."""
        if meta is not None and self.kv_group:
            meta = meta.of_group(self.kv_group)
        cached = meta is not None and self.k_cache is not None
        if rotary is not None:
            rope, positions = rotary
            if cached and _use_triton(q) and rope.fuses_kv_store(positions, q):
                if meta.is_decode and q.shape[0] >= FUSED_ROTARY_MIN_BATCH:
                    # the decode kernel rotates and stores itself: one launch fewer
                    q, k = _head_norms(q, k, qk_norm)
                    fused = (rope.cos, rope.sin, positions, k, v, meta.slot_mapping)
                    return self._paged_triton(q, meta, quantize, rotary=fused, sinks=sinks)
                q_out = self.cut.rotated_q(q) if self.cut is not None and not meta.is_decode else None
                q = rope.rotate_and_store(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                          self.kv_scales(self.k_cache.dtype), qk_norm=qk_norm, q_out=q_out)
                return self._paged_triton(q, meta, quantize, sinks=sinks)
            q, k = rope(positions, *_head_norms(q, k, qk_norm))
        else:
            q, k = _head_norms(q, k, qk_norm)
        if not cached:
            return self._causal_no_cache(q, k, v, sinks)
        scales = self.kv_scales(self.k_cache.dtype)
        if _use_triton(q):
            from radiance.layers.attention_prefill import store_kv_cache
            store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, scales)
            # unrotated (a NoPE layer), q is still a strided view of the qkv output
            return self._paged_triton(q.contiguous(), meta, quantize, sinks=sinks)
        store_kv_cache_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.slots_valid, scales)
        out = paged_attention_torch(q, self.k_cache, self.v_cache, meta.block_tables, meta.q_lens,
                                    meta.kv_lens, self.scale, meta.kv_first_blocks, scales, sinks,
                                    self.sliding_window, self.softcap, attention_chunk=self.attention_chunk)
        return out.reshape(*out.shape[:-2], self.num_heads * self.head_dim)

    def _paged_triton(self, q: torch.Tensor, meta: AttentionMetadata, quantize: bool = False,
                      rotary: tuple | None = None, sinks: torch.Tensor | None = None):
        """Attention of q over the paged cache, which already holds this step's K/V; at decode, with
        `rotary` (see paged_decode_attention), q is unrotated and the kernel rotates and stores K/V."""
        from radiance.layers import attention_triton as at
        scales = self.kv_scales(self.k_cache.dtype)
        if meta.is_decode:
            out = at.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                            meta.context_lens, self.scale, meta.decode_splits, quantize, rotary,
                                            kv_scales=scales, sinks=sinks, sliding_window=self.sliding_window,
                                            softcap=self.softcap, attention_chunk=self.attention_chunk)
            if isinstance(out, tuple):
                return Fp8Activations(*out, q.dtype, tuple(q.shape[:-2]))
        elif self.cut is not None:  # capturing piecewise graphs: the capture runs it between two pieces
            out = self.cut(self, q, meta, sinks)
        else:
            out = self.prefill_attention(q, meta, sinks)
        return out.reshape(*out.shape[:-2], self.num_heads * self.head_dim)

    def prefill_attention(self, q: torch.Tensor, meta: AttentionMetadata, sinks: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """The Triton prefill attention of rotated q [T, Hq, D] over the cache, which holds this step's K/V
        (into `out` when given): one launch, its grid and tiling from meta's host lengths."""
        from radiance.layers import attention_prefill as ap
        return ap.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                          meta.cu_seqlens_q, max(meta.q_lens), self.scale,
                                          self.kv_scales(self.k_cache.dtype), max_kv_len=max(meta.kv_lens),
                                          sinks=sinks, sliding_window=self.sliding_window, out=out,
                                          softcap=self.softcap, attention_chunk=self.attention_chunk)

    def _causal_no_cache(self, q, k, v, sinks: torch.Tensor | None = None):
        scales = UNIT_SCALES
        if self.kv_storage_dtype is not None:  # K/V as a cache of that dtype holds them, scales folded as there
            scales = self.kv_scales(self.kv_storage_dtype)
            k = to_cache_dtype(k, self.kv_storage_dtype, scales.k).to(k.dtype)
            v = to_cache_dtype(v, self.kv_storage_dtype, scales.v).to(v.dtype)
        squeeze = q.dim() == 3  # [T, H, D] -> one sequence
        if squeeze:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if sinks is None and self.sliding_window is None and self.softcap is None and self.attention_chunk is None:
            out = _sdpa(q, k, v, self.scale * scales.k, causal=True)
        else:
            out = _windowed_attention(q, k, v, 0, self.scale * scales.k, sinks, self.sliding_window, self.softcap,
                                      self.attention_chunk)
        out = _scaled_output(out, scales)
        if squeeze:
            out = out.squeeze(0)
        return out.reshape(*out.shape[:-2], self.num_heads * self.head_dim)


def _scaled_output(out: torch.Tensor, scales: KvScales) -> torch.Tensor:
    """Attention over V / v as stored, times v (a convex combination of the rows commutes with it)."""
    return out if scales.v == 1.0 else (out.float() * scales.v).to(out.dtype)


def _sdpa(q, k, v, scale: float, causal: bool = False, mask: torch.Tensor | None = None):
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> [B, Tq, Hq, D], GQA inside SDPA (no repeated kv heads)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                         enable_gqa=q.shape[-2] != k.shape[-2])
    return out.transpose(1, 2)


def _window_start(kv_len: int, q_len: int, window: int | None, chunk: int | None = None) -> int:
    """The first context position any of the last q_len queries of a kv_len context sees: the first query's
    window start, or its chunk's."""
    first = 0 if window is None else max(0, kv_len - q_len + 1 - window)
    return first if chunk is None else max(first, (kv_len - q_len) // chunk * chunk)


def _windowed_attention(q, k, v, first: int, scale: float, sinks: torch.Tensor | None, window: int | None,
                        softcap: float | None = None, chunk: int | None = None):
    """Causal attention of q [B, Tq, Hq, D], the context's last Tq tokens, over its rows from position
    `first` on (k/v [B, kv_len - first, Hkv, D]), within `window` (None: unlimited) and the query's
    `chunk` (None: no chunks), each head's sink logit in the denominator (None: no sinks), the logits
    soft-capped at `softcap` (None: not). In float32, the sinks' precision."""
    kv_len = first + k.shape[1]
    queries = torch.arange(kv_len - q.shape[1], kv_len, device=q.device)[:, None]
    keys = torch.arange(first, kv_len, device=q.device)[None, :]
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    if chunk is not None:
        allowed &= keys >= queries // chunk * chunk
    q32, k32, v32 = q.float(), k.float(), v.float()
    if softcap is not None:
        if sinks is not None:
            raise ValueError("soft-capped attention with sinks is not supported")
        return _soft_capped_attention(q32, k32, v32, allowed, scale, softcap).to(q.dtype)
    if sinks is not None:
        # an infinite sink as a finite one as far out (no weight, or all of it): the real keys' 0 x sink
        # in the extra dimension must stay 0, not NaN
        sinks = sinks.float().clamp(-1e30, 1e30)
        q32, k32, v32, allowed = _with_sink_key(q32, k32, v32, allowed, sinks / scale)
    return _sdpa(q32, k32, v32, scale, mask=allowed).to(q.dtype)


def _soft_capped_attention(q, k, v, allowed, scale: float, softcap: float):
    """Gemma 2's attention (SDPA has no soft cap): each logit q.k * scale becomes softcap * tanh(logit / softcap),
    then the mask and the softmax; q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D]."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = torch.tanh(logits / softcap) * softcap
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _with_sink_key(q, k, v, allowed, sink_dots):
    """q, k, v and the mask with the sinks as a key every query sees, ahead of the others, whose value is 0:
    one more dimension holds each q head's sink / scale in q, 1 in that key and 0 in the real keys, so its
    logit is the (unscaled) sink and theirs do not change. Memory stays O(tokens x heads), unlike a float
    mask that would carry the per-head sink over every (query, key) pair."""
    batch, q_len, heads, _ = q.shape
    q = torch.cat([q, sink_dots.view(1, 1, heads, 1).expand(batch, q_len, heads, 1)], -1)
    k = torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], -1)
    sink_key = k.new_zeros(batch, 1, *k.shape[2:])
    sink_key[..., -1] = 1.0
    k = torch.cat([sink_key, k], 1)
    v = torch.cat([v.new_zeros(batch, 1, *v.shape[2:]), v], 1)
    allowed = torch.cat([allowed.new_ones(allowed.shape[0], 1), allowed], 1)
    return q, k, v, allowed


def _decode_sdpa(q, k, v, scale: float):
    """SDPA of one query row, in float32: PyTorch's CPU SDPA decodes one 16-bit query 1.7x (101 keys) to
    4.4x (1000 keys) slower than the same call on float32 copies (bench/RESULTS.md, tenth session)."""
    return _sdpa(q.float(), k.float(), v.float(), scale).to(q.dtype)


# index_select / index_copy_ rather than advanced indexing: the caches are views into one large tensor,
# and advanced indexing on such a view costs time proportional to the whole tensor (measured: 8 ms vs
# 0.007 ms per call for a 537 MB cache on the CPU, torch 2.13).
def store_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping, slots_valid: bool = False,
                         scales: KvScales = UNIT_SCALES):
    k_rows, v_rows, slots = k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]), slot_mapping
    if k_rows.dtype != k_cache.dtype:  # a float32 cache on the CPU (widened exactly) or fp8 (kv_cache_dtype)
        k_rows = to_cache_dtype(k_rows, k_cache.dtype, scales.k)
        v_rows = to_cache_dtype(v_rows, v_cache.dtype, scales.v)
    if not slots_valid and slots.numel() and int(slots.min()) < 0:  # rows to skip (-1): select the others
        valid = slots >= 0
        k_rows, v_rows, slots = k_rows[valid], v_rows[valid], slots[valid]
    for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K/V rows as the cache stores them: an fp8 cache holds x / scale (times the float32 inverse, as the
    Triton stores do), saturating at +-448 and rounding to nearest even; a wider one holds x exactly."""
    if dtype == torch.float8_e4m3fn:
        x = x.float() if scale == 1.0 else x.float() * _fp32_inverse(scale)
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    block_size = cache.shape[1]
    skipped = start // block_size  # blocks wholly before `start` are not read
    blocks = block_table[skipped: (length + block_size - 1) // block_size]  # int32 indices: no conversion op
    offset = skipped * block_size
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[start - offset:length - offset]


def cached_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = -1,
              start: int = 0) -> torch.Tensor:
    """One sequence's cached rows [start, length) [length - start, Hkv, D]: a view of the cache when its
    blocks run in order from `first_block` (AttentionMetadata.kv_first_blocks), else gathered block by block."""
    if first_block >= 0:
        base = first_block * cache.shape[1]
        return cache.view(-1, *cache.shape[2:])[base + start:base + length]
    return gather_kv(cache, block_table, length, start)


def paged_attention_torch(q, k_cache, v_cache, block_tables, q_lens, kv_lens, scale, first_blocks=None,
                          scales: KvScales = UNIT_SCALES, sinks: torch.Tensor | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          attention_chunk: int | None = None):
    """Reference paged attention: q [T, Hq, D] flattened over sequences -> [T, Hq, D]. The cache may be
    wider than q (float32 on the CPU): decode attends in float32 anyway, prefill in q's dtype (float32
    with sinks, a window or chunks). An fp8 cache holds K / scales.k and V / scales.v (KvScales).
    attention_chunk C: the query at position p sees only keys (p // C) * C <= j <= p (None: no chunks)."""
    if scales != UNIT_SCALES:
        out = paged_attention_torch(q, k_cache, v_cache, block_tables, q_lens, kv_lens, scale * scales.k,
                                    first_blocks, sinks=sinks, sliding_window=sliding_window, softcap=softcap,
                                    attention_chunk=attention_chunk)
        return _scaled_output(out, scales)
    firsts = first_blocks or [-1] * len(q_lens)
    if sinks is not None or sliding_window is not None or softcap is not None or attention_chunk is not None:
        return _paged_windowed_attention(q, k_cache, v_cache, block_tables, q_lens, kv_lens, scale, firsts,
                                         sinks, sliding_window, softcap, attention_chunk)
    if len(q_lens) == 1 and q_lens[0] == 1:  # one sequence's decode step (the CPU's usual case): no copy-out
        k_1 = cached_kv(k_cache, block_tables[0], kv_lens[0], firsts[0])
        v_1 = cached_kv(v_cache, block_tables[0], kv_lens[0], firsts[0])
        return _decode_sdpa(q.unsqueeze(0), k_1.unsqueeze(0), v_1.unsqueeze(0), scale)[0]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        q_i = q[start:start + q_len].unsqueeze(0)
        k_i = cached_kv(k_cache, block_tables[i], kv_len, firsts[i]).unsqueeze(0)
        v_i = cached_kv(v_cache, block_tables[i], kv_len, firsts[i]).unsqueeze(0)
        if q_len > 1 and k_i.dtype != q.dtype:  # the 16-bit values the cache holds, exactly
            k_i, v_i = k_i.to(q.dtype), v_i.to(q.dtype)
        if q_len == 1:
            o = _decode_sdpa(q_i, k_i, v_i, scale)
        elif q_len == kv_len:
            o = _sdpa(q_i, k_i, v_i, scale, causal=True)
        else:  # new tokens sit at the end of the context: row j sees keys up to kv_len - q_len + j
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (kv_len - q_len)
            mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= rows
            o = _sdpa(q_i, k_i, v_i, scale, mask=mask)
        out[start:start + q_len] = o.squeeze(0)
        start += q_len
    return out


def _paged_windowed_attention(q, k_cache, v_cache, block_tables, q_lens, kv_lens, scale, firsts, sinks, window,
                              softcap=None, chunk=None):
    """paged_attention_torch with sinks, a sliding window, chunks and / or a soft cap: each sequence reads only
    the cached rows from its first query's window (or chunk) on."""
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        first = _window_start(kv_len, q_len, window, chunk)
        k_i = cached_kv(k_cache, block_tables[i], kv_len, firsts[i], first).unsqueeze(0)
        v_i = cached_kv(v_cache, block_tables[i], kv_len, firsts[i], first).unsqueeze(0)
        q_i = q[start:start + q_len].unsqueeze(0)
        out[start:start + q_len] = _windowed_attention(q_i, k_i, v_i, first, scale, sinks, window,
                                                       softcap, chunk).squeeze(0)
        start += q_len
    return out
