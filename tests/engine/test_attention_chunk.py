"""Llama 4's chunked local attention (`attention_chunk` C: the query at position p sees the keys
(p // C) * C <= j <= p, as transformers' create_chunked_causal_mask) on the torch paths (CPU): the paged
reference and the no-cache path against a dense masked softmax computed here, and Attention's checks. The
Triton kernels against these references: tests/kernels/triton_cases_attention_chunk.py."""

from __future__ import annotations

import pytest
import torch

from radiance.layers.attention import Attention, AttentionMetadata, cached_kv, paged_attention_torch
from tests.engine.test_attention_sinks import DIM, HEADS, KV_HEADS, PAGE, paged_cache, random_sinks


def dense_attention(q, k, v, scale, chunk=None, window=None, sinks=None):
    """Brute force in float64: q [Tq, Hq, D], the last Tq of the Tk tokens of k/v [Tk, Hkv, D] -> [Tq, Hq, D].
    Every (query, key) pair is masked by position: causal, within the query's chunk, within the window."""
    q_len, heads, _ = q.shape
    kv_len = k.shape[0]
    group = heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for row in range(q_len):
        p = kv_len - q_len + row
        for j in range(kv_len):
            allowed[row, j] = (j <= p and (chunk is None or j // chunk == p // chunk)
                               and (window is None or p - j < window))
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().reshape(-1, 1, 1).expand(heads, q_len, 1)], dim=-1)
    probs = logits.softmax(-1)[..., :kv_len]
    return torch.einsum("hqk,khd->qhd", probs, v)


def dense_paged(q, k_cache, v_cache, block_tables, seqs, scale, **options):
    out, start = [], 0
    for i, (q_len, before) in enumerate(seqs):
        k = cached_kv(k_cache, block_tables[i], q_len + before)
        v = cached_kv(v_cache, block_tables[i], q_len + before)
        out.append(dense_attention(q[start:start + q_len], k, v, scale, **options))
        start += q_len
    return torch.cat(out)


# (new tokens, cached tokens before them): a fresh prefill of 40 (chunks of 16: 2 boundaries; of 4: 9), a
# chunked prefill starting mid-context (43..47, across 44 for chunks of 4), one across 32 (26..37), decodes at
# the last token of a chunk (47), at the first token of one (48, 64), at one token, and a prefill from a chunk
# start (16..27)
SEQS = [(40, 0), (5, 43), (12, 26), (1, 47), (1, 48), (1, 64), (1, 0), (12, 16)]
CHUNKS = [1, 4, 7, 16, 64, 1000]  # itself only, many boundaries, off the pages, 1-3 boundaries, 0-1, none


def _lens(seqs):
    return [n for n, _ in seqs], [n + c for n, c in seqs]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_paged_torch_matches_dense(chunk):
    q, k_cache, v_cache, tables = paged_cache(SEQS, seed=10)
    q_lens, kv_lens = _lens(SEQS)
    scale = DIM ** -0.5
    want = dense_paged(q, k_cache, v_cache, tables, SEQS, scale, chunk=chunk)
    got = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, scale, attention_chunk=chunk)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # each sequence alone, read in place where its blocks run in order (one decode: the single-sequence path)
    in_order = torch.arange(1, 1 + tables.shape[1], dtype=torch.int32).unsqueeze(0)
    start = 0
    for seq, q_len, kv_len in zip(SEQS, q_lens, kv_lens):
        rows = slice(start, start + q_len)
        alone = paged_attention_torch(q[rows], k_cache, v_cache, in_order, [q_len], [kv_len], scale, [1],
                                      attention_chunk=chunk)
        want_alone = dense_paged(q[rows], k_cache, v_cache, in_order, [seq], scale, chunk=chunk)
        torch.testing.assert_close(alone.double(), want_alone, rtol=1e-5, atol=1e-5)
        start += q_len


def test_chunks_change_what_crosses_a_boundary_only():
    """Against plain causal attention: a chunk past every context changes nothing; chunks of 16 change the
    rows past position 15 and no row below it; chunks of 1 give each query its own value."""
    q, k_cache, v_cache, tables = paged_cache(SEQS, seed=11)
    q_lens, kv_lens = _lens(SEQS)
    plain = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25)
    wide = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, attention_chunk=1000)
    torch.testing.assert_close(wide, plain, rtol=1e-5, atol=1e-6)
    sixteen = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, attention_chunk=16)
    positions = torch.cat([torch.arange(c, c + n) for n, c in SEQS])
    differs = (sixteen - plain).abs().amax((1, 2)) > 1e-4
    assert torch.equal(differs, positions >= 16)
    own = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, attention_chunk=1)
    values = torch.cat([cached_kv(v_cache, tables[i], c + n)[c:] for i, (n, c) in enumerate(SEQS)])
    torch.testing.assert_close(own, values.repeat_interleave(HEADS // KV_HEADS, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk,window,with_sinks", [(16, None, True), (16, 5, False), (4, 9, True)])
def test_chunks_with_the_other_options(chunk, window, with_sinks):
    """paged_attention_torch composes a chunk with sinks, and with a window (the keys inside both; Attention
    takes one of the two per layer)."""
    sinks = random_sinks(12) if with_sinks else None
    q, k_cache, v_cache, tables = paged_cache(SEQS, seed=12)
    q_lens, kv_lens = _lens(SEQS)
    want = dense_paged(q, k_cache, v_cache, tables, SEQS, DIM ** -0.5, chunk=chunk, window=window, sinks=sinks)
    got = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, DIM ** -0.5, sinks=sinks,
                                sliding_window=window, attention_chunk=chunk)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("batched", [True, False])
def test_causal_no_cache_matches_dense(chunk, batched):
    """Evaluation's path (no cache): a [B, T] batch or one [T] sequence of 40 tokens."""
    gen = torch.Generator().manual_seed(13)
    batch, tokens = 2, 40
    q = torch.randn(batch, tokens, HEADS, DIM, generator=gen)
    k = torch.randn(batch, tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(batch, tokens, KV_HEADS, DIM, generator=gen)
    if not batched:
        q, k, v = q[0], k[0], v[0]
    got = Attention(HEADS, KV_HEADS, DIM, attention_chunk=chunk)(q, k, v, None).view(*q.shape)
    for b in range(batch if batched else 1):
        rows = (q[b], k[b], v[b]) if batched else (q, k, v)
        want = dense_attention(*rows, DIM ** -0.5, chunk=chunk)
        torch.testing.assert_close((got[b] if batched else got).double(), want, rtol=1e-5, atol=1e-5)


def test_attention_forward_passes_the_chunk_to_the_paged_path():
    """Attention.forward on the CPU with a cache: 11 tokens, a chunk of 5 across position 16, then two decode
    steps (positions 16 and 17 with chunks of 8)."""
    gen = torch.Generator().manual_seed(14)
    attn = Attention(HEADS, KV_HEADS, DIM, attention_chunk=8)
    attn.k_cache = torch.zeros(8, PAGE, KV_HEADS, DIM)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    table = torch.tensor([[3, 0, 6, 1, 5]], dtype=torch.int32)
    k_all = torch.randn(18, KV_HEADS, DIM, generator=gen)
    v_all = torch.randn(18, KV_HEADS, DIM, generator=gen)
    q_all = torch.randn(18, HEADS, DIM, generator=gen)
    slots = torch.tensor([int(table[0, p // PAGE]) * PAGE + p % PAGE for p in range(18)])
    for new in (range(0, 11), range(11, 16), range(16, 17), range(17, 18)):
        rows = list(new)
        meta = AttentionMetadata(slot_mapping=slots[rows], block_tables=table, context_lens=torch.tensor([new.stop]),
                                 cu_seqlens_q=torch.tensor([0, len(rows)]), q_lens=[len(rows)], kv_lens=[new.stop],
                                 is_decode=len(rows) == 1)
        got = attn(q_all[rows], k_all[rows], v_all[rows], meta).view(len(rows), HEADS, DIM)
        want = dense_attention(q_all[rows], k_all[:new.stop], v_all[:new.stop], DIM ** -0.5, chunk=8)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_chunk_must_hold_a_token_and_excludes_a_window():
    with pytest.raises(ValueError, match="attention_chunk"):
        Attention(HEADS, KV_HEADS, DIM, attention_chunk=0)
    with pytest.raises(ValueError, match="attention_chunk"):
        Attention(HEADS, KV_HEADS, DIM, attention_chunk=-8)
    with pytest.raises(ValueError, match="not both"):
        Attention(HEADS, KV_HEADS, DIM, sliding_window=4, attention_chunk=8)
    assert Attention(HEADS, KV_HEADS, DIM).attention_chunk is None
    assert Attention(HEADS, KV_HEADS, DIM, attention_chunk=8192).attention_chunk == 8192


def test_the_kernels_check_the_chunk():
    from radiance.layers.attention_triton import _chunk
    assert _chunk(None) == 0 and _chunk(1) == 1 and _chunk(8192) == 8192
    with pytest.raises(ValueError, match="attention_chunk"):
        _chunk(0)
