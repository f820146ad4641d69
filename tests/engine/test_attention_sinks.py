"""gpt-oss's attention options on the torch path (CPU): sinks (a learned logit per q head in every
softmax denominator) and a sliding window, against a direct dense implementation of HF transformers'
GptOss eager attention; and the paths without them, unchanged."""

from __future__ import annotations

import pytest
import torch

from radiance.layers import attention
from radiance.layers.attention import (Attention, AttentionMetadata, KvScales, cached_kv, paged_attention_torch,
                                       store_kv_cache_torch)

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 16, 4


def hf_eager_attention(q, k, v, scale, sinks=None, window=None):
    """HF GptOss eager attention in float64: q [Tq, Hq, D], the last Tq of the Tk tokens of k/v [Tk, Hkv, D]
    -> [Tq, Hq, D]. The sink joins the logits unscaled, its column dropped after the softmax."""
    q_len, heads, _ = q.shape
    kv_len = k.shape[0]
    group = heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    w = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    logits = w.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().reshape(-1, 1, 1).expand(heads, q_len, 1)], dim=-1)
    logits = logits - logits.max(-1, keepdim=True).values
    probs = logits.softmax(-1)[..., :kv_len]
    return torch.einsum("hqk,khd->qhd", probs, v)


def random_sinks(seed: int = 0) -> torch.Tensor:
    # around the scores' scale, one head far above (the sink takes nearly all) and one far below
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[1] = 9.0, -9.0
    return sinks


def paged_cache(seq_shapes, dtype=torch.float32, seed=0):
    """Random K/V caches [blocks, PAGE, Hkv, D] and, per sequence (q_len, cached tokens before), a shuffled
    block table; q [sum q_len, Hq, D]."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(q_len + before) // PAGE) for q_len, before in seq_shapes) + 2
    k_cache = torch.randn(blocks, PAGE, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, PAGE, KV_HEADS, DIM, generator=gen).to(dtype)
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(q_len + before) // PAGE))] for q_len, before in seq_shapes]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_len for q_len, _ in seq_shapes), HEADS, DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables


def hf_paged_reference(q, k_cache, v_cache, block_tables, seq_shapes, scale, sinks, window):
    out, start = [], 0
    for i, (q_len, before) in enumerate(seq_shapes):
        k = cached_kv(k_cache, block_tables[i], q_len + before)
        v = cached_kv(v_cache, block_tables[i], q_len + before)
        out.append(hf_eager_attention(q[start:start + q_len], k, v, scale, sinks, window))
        start += q_len
    return torch.cat(out)


# (new tokens, cached tokens before them): fresh prefill, chunked prefill after context, decode at 20 and
# at 1 token of context, a prefill as long as the window of 20
SEQS = [(9, 0), (4, 16), (1, 19), (1, 0), (20, 0)]
WINDOWS = [None, 1, 3, 20, 1000]  # none, itself only, below every context, equal to some, above all


@pytest.mark.parametrize("window,with_sinks", [(w, True) for w in WINDOWS] + [(w, False) for w in WINDOWS[1:]])
def test_paged_torch_matches_hf_eager(window, with_sinks):
    sinks = random_sinks() if with_sinks else None
    q, k_cache, v_cache, tables = paged_cache(SEQS)
    q_lens, kv_lens = [n for n, _ in SEQS], [n + c for n, c in SEQS]
    scale = DIM ** -0.5
    want = hf_paged_reference(q, k_cache, v_cache, tables, SEQS, scale, sinks, window)
    got = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, scale, sinks=sinks,
                                sliding_window=window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # each sequence alone (one decode: the single-sequence path), read in place where its blocks run in order
    in_order = torch.arange(1, 1 + tables.shape[1], dtype=torch.int32).unsqueeze(0)  # blocks 1, 2, ...
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(start, start + q_len)
        alone = paged_attention_torch(q[rows], k_cache, v_cache, in_order, [q_len], [kv_len], scale, [1],
                                      sinks=sinks, sliding_window=window)
        want_alone = hf_paged_reference(q[rows], k_cache, v_cache, in_order, [SEQS[i]], scale, sinks, window)
        torch.testing.assert_close(alone.double(), want_alone, rtol=1e-5, atol=1e-5)
        start += q_len


def test_fp8_scales_scale_the_scores_and_values_not_the_sinks():
    """An fp8 cache holds K / k and V / v: the scores carry k and the output v, the sink neither."""
    sinks = random_sinks(1)
    q, k_cache, v_cache, tables = paged_cache(SEQS, seed=1)
    scales = KvScales(k=2.5, v=0.3)
    q_lens, kv_lens = [n for n, _ in SEQS], [n + c for n, c in SEQS]
    got = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, DIM ** -0.5, scales=scales,
                                sinks=sinks, sliding_window=3)
    want = hf_paged_reference(q, k_cache * 2.5, v_cache * 0.3, tables, SEQS, DIM ** -0.5, sinks, 3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 4, 9, 50])
@pytest.mark.parametrize("batched", [True, False])
def test_causal_no_cache_matches_hf_eager(window, batched):
    """Evaluation's path (no cache): a [B, T] batch or one [T] sequence, sinks on and off."""
    gen = torch.Generator().manual_seed(2)
    batch, tokens = 3, 9
    q = torch.randn(batch, tokens, HEADS, DIM, generator=gen)
    k = torch.randn(batch, tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(batch, tokens, KV_HEADS, DIM, generator=gen)
    if not batched:
        q, k, v = q[0], k[0], v[0]
    attn = Attention(HEADS, KV_HEADS, DIM, sliding_window=window)
    for sinks in (random_sinks(2), None):
        got = attn(q, k, v, None, sinks=sinks).view(*q.shape)
        for b in range(batch if batched else 1):
            rows = (q[b], k[b], v[b]) if batched else (q, k, v)
            want = hf_eager_attention(*rows, DIM ** -0.5, sinks, window)
            torch.testing.assert_close((got[b] if batched else got).double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_attend_in_float32():
    """16-bit q/k/v come back in their dtype, from float32 math (the sinks' precision)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, HEADS, DIM, generator=gen).to(torch.bfloat16)
    k = torch.randn(12, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(12, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    sinks = random_sinks(3)
    got = Attention(HEADS, KV_HEADS, DIM, sliding_window=5)(q, k, v, None, sinks=sinks).view(12, HEADS, DIM)
    assert got.dtype == torch.bfloat16
    want = hf_eager_attention(q, k, v, DIM ** -0.5, sinks, 5)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=2e-3)


def test_attention_forward_passes_the_options_to_the_paged_path():
    """Attention.forward on the CPU with a cache: a chunk of 5 after 11 cached tokens, then a decode step."""
    gen = torch.Generator().manual_seed(4)
    attn = Attention(HEADS, KV_HEADS, DIM, sliding_window=6)
    attn.k_cache = torch.zeros(8, PAGE, KV_HEADS, DIM)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    table = torch.tensor([[3, 0, 6, 1, 5]], dtype=torch.int32)
    k_all = torch.randn(17, KV_HEADS, DIM, generator=gen)
    v_all = torch.randn(17, KV_HEADS, DIM, generator=gen)
    q_all = torch.randn(17, HEADS, DIM, generator=gen)
    slots = torch.tensor([int(table[0, p // PAGE]) * PAGE + p % PAGE for p in range(17)])
    store_kv_cache_torch(k_all[:11], v_all[:11], attn.k_cache, attn.v_cache, slots[:11])
    sinks = random_sinks(4)
    for new in (range(11, 16), range(16, 17)):
        rows = list(new)
        meta = AttentionMetadata(slot_mapping=slots[rows], block_tables=table, context_lens=torch.tensor([new.stop]),
                                 cu_seqlens_q=torch.tensor([0, len(rows)]), q_lens=[len(rows)], kv_lens=[new.stop],
                                 is_decode=len(rows) == 1)
        got = attn(q_all[rows], k_all[rows], v_all[rows], meta, sinks=sinks).view(len(rows), HEADS, DIM)
        want = hf_eager_attention(q_all[rows], k_all[:new.stop], v_all[:new.stop], DIM ** -0.5, sinks, 6)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_without_the_options_the_existing_path_runs(monkeypatch):
    """sinks=None and sliding_window=None never reach the new code: every existing branch as before."""
    monkeypatch.setattr(attention, "_windowed_attention", lambda *a: pytest.fail("options path taken"))
    q, k_cache, v_cache, tables = paged_cache(SEQS)
    q_lens, kv_lens = [n for n, _ in SEQS], [n + c for n, c in SEQS]
    plain = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25)
    explicit = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, sinks=None,
                                     sliding_window=None)
    assert torch.equal(plain, explicit)
    attn = Attention(HEADS, KV_HEADS, DIM)
    assert attn.sliding_window is None
    attn(q[:9].unsqueeze(0), torch.randn(1, 9, KV_HEADS, DIM), torch.randn(1, 9, KV_HEADS, DIM), None)


def test_degenerate_options_give_plain_attention():
    """Sinks of -inf and a window past every context reduce to plain causal attention; a sink far above
    every score takes the whole denominator (output ~0)."""
    q, k_cache, v_cache, tables = paged_cache(SEQS, seed=5)
    q_lens, kv_lens = [n for n, _ in SEQS], [n + c for n, c in SEQS]
    plain = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25)
    no_sinks = torch.full((HEADS,), float("-inf"))
    options = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, sinks=no_sinks,
                                    sliding_window=10 ** 6)
    torch.testing.assert_close(options, plain, rtol=1e-5, atol=1e-6)
    huge = torch.full((HEADS,), 80.0)
    swamped = paged_attention_torch(q, k_cache, v_cache, tables, q_lens, kv_lens, 0.25, sinks=huge)
    assert swamped.abs().max() < 1e-20


def test_reading_from_a_window_start_gives_the_tail_of_the_context():
    k_cache, _ = paged_cache(SEQS)[1:3]
    table = torch.tensor([7, 2, 9, 4, 0], dtype=torch.int32)
    full = cached_kv(k_cache, table, 18)
    for start in (0, 3, 4, 13, 17):
        assert torch.equal(cached_kv(k_cache, table, 18, start=start), full[start:])
        in_place = cached_kv(k_cache, table, 18, first_block=2, start=start)
        assert torch.equal(in_place, cached_kv(k_cache, table, 18, first_block=2)[start:])


def test_a_window_must_hold_a_token():
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(HEADS, KV_HEADS, DIM, sliding_window=0)
