"""Llama 4's chunked local attention (attention_chunk C: the query at position p sees the keys
(p // C) * C <= j <= p) in the Triton prefill and decode kernels, the fused-rotary decode and over fp8 caches,
against paged_attention_torch (itself checked against a dense masked softmax in
tests/engine/test_attention_chunk.py) on caches whose rows below each sequence's first chunk are NaN: the
kernels must skip them. Run on CUDA, or on the CPU through the Triton interpreter by test_triton_interpreter.py
(small shapes and fp32 or fp16 dots there; bf16 and the larger layouts only on the GPU)."""

import pytest
import torch

from radiance.layers import attention_prefill as ap, attention_triton as at
from radiance.layers.attention import KvScales, UNIT_SCALES, _window_start, paged_attention_torch
from radiance.layers.attention_prefill import PrefillTiling
from radiance.layers.attention_triton import DecodeTiling
from tests.engine.test_attention_sinks_triton import _paged_batch
from tests.engine.test_attention_triton import check_fused_decode

# (new tokens, cached tokens before them): a fresh prefill of 40, chunked prefills starting mid-context (43..47,
# 26..37, 90..109), decodes at a chunk's last token (47), at the first (48, 64, 128) and at one token
SHAPES = [(40, 0), (5, 43), (12, 26), (1, 47), (1, 48), (1, 64), (1, 0), (20, 90), (1, 128)]
SMALL = PrefillTiling(16, 16)  # q tiles of 16 straddle chunks of 4, 16 and 24, sit inside chunks of 64


def _poisoned(cache, tables, shapes, chunk, window, granule):
    """A copy of the cache with NaN in each sequence's rows below its first query's chunk (or window) start,
    rounded down to `granule` (the launches' largest BLOCK_N, whole pages): rows no kernel may read."""
    poisoned = cache.clone()
    page = cache.shape[1]
    assert granule % page == 0
    for table, (q_len, before) in zip(tables.tolist(), shapes):
        first = _window_start(before + q_len, q_len, window, chunk)
        for block in table[:first // granule * granule // page]:
            poisoned[block] = float("nan")
    return poisoned


def check_chunks(device, dtype, cases, shapes=SHAPES, kv_dtype=None, scales=None, heads=4, kv_heads=2,
                 head_dim=32, page=16, prefill_tilings=(SMALL,), decode_splits=(1, 3), granule=64, seed=0,
                 bound=True) -> dict:
    """For each (chunk, window) case: paged_prefill_attention over every sequence (max_kv_len: the longest context
    where `bound` is True, none where False, else `bound` itself) and paged_decode_attention over the one-token ones against paged_attention_torch on the poisoned
    cache. Returns the worst relative
    errors, the outputs holding a NaN, and the least relative distance of a chunked reference from the
    unchunked one (chunks below the contexts: the chunks matter)."""
    gen = torch.Generator().manual_seed(seed)
    scales = scales or UNIT_SCALES
    q, k0, v0, tables = _paged_batch(device, dtype, kv_dtype or dtype, heads, kv_heads, head_dim, page, shapes, gen)
    q_lens, kv_lens = [n for n, _ in shapes], [n + c for n, c in shapes]
    context_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    rows = cu[:-1][decode].long()
    scale = head_dim ** -0.5
    errors = {"prefill": 0.0, "decode": 0.0, "nan": 0, "effect": float("inf")}

    def note(kind, out, ref):
        errors["nan"] += int(torch.isnan(out).any().item())
        errors[kind] = max(errors[kind], ((out.float() - ref).norm() / ref.norm()).item())

    longest = max(kv_lens) if bound is True else None if bound is False else bound
    full = paged_attention_torch(q.float(), k0.float(), v0.float(), tables, q_lens, kv_lens, scale, scales=scales)
    for chunk, window in cases:
        options = {"attention_chunk": chunk, "sliding_window": window}
        k_cache = _poisoned(k0, tables, shapes, chunk, window, granule)
        v_cache = _poisoned(v0, tables, shapes, chunk, window, granule)
        ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), tables, q_lens, kv_lens, scale,
                                    scales=scales, **options)
        if chunk < max(kv_lens):
            errors["effect"] = min(errors["effect"], ((ref - full).norm() / full.norm()).item())
        for tiling in prefill_tilings:
            note("prefill", ap.paged_prefill_attention(q, k_cache, v_cache, tables, context_lens, cu, max(q_lens),
                                                       scale, scales, tiling=tiling,
                                                       max_kv_len=longest, **options), ref)
        for splits in decode_splits:
            note("decode", at.paged_decode_attention(q[rows], k_cache, v_cache, tables[decode], context_lens[decode],
                                                     scale, splits, kv_scales=scales, **options), ref[rows])
    # a graph bucket's padding row (context 0): zeros, not NaN
    padded = at.paged_decode_attention(q[:1], k0, v0, tables[:1], torch.zeros(1, dtype=torch.int32, device=device),
                                       scale, 3, attention_chunk=cases[0][0])
    errors["nan"] += int(torch.isnan(padded).any().item())
    return errors


def _assert_close(errors, tol):
    assert errors["prefill"] < tol and errors["decode"] < tol and errors["nan"] == 0, errors
    # the chunks below the contexts change the result, so matching depends on them (inf: none below)
    assert errors["effect"] > 0.05, errors


@pytest.mark.parametrize("chunk", [4, 16, 24, 64])
def test_chunked_prefill_and_decode_match_torch(device, chunk):
    """Tiles of 16 (chunks of 4 and 24 straddled by tiles; 64: unmasked tiles inside a chunk), decode at 1 and
    3 splits; fp32."""
    _assert_close(check_chunks(device, torch.float32, [(chunk, None)], seed=chunk), 1e-5)


@pytest.mark.parametrize("bound", [True, False])
def test_a_chunk_past_every_context(device, bound):
    """Plain causal attention: the chunked kernel finds every tile inside the first chunk."""
    _assert_close(check_chunks(device, torch.float32, [(1000, None)], decode_splits=(3,), seed=7, bound=bound),
                  1e-5)


def test_a_short_max_kv_len_still_chunks_longer_contexts(device):
    """A prefill graph is captured with max_kv_len its bucket (step_graphs.PrefillGraphs) and replayed for longer
    contexts: a bound below the chunk must not launch the kernel without the chunk mask."""
    _assert_close(check_chunks(device, torch.float32, [(16, None)], decode_splits=(), seed=3, bound=8), 1e-5)


def test_default_tilings_and_a_window_inside_the_chunks(device):
    """The launchers' own tilings (q tiles of 64 across chunks of 16 and inside chunks of 100, whose
    start is off the tiles), 8 splits; and a window of 10 with chunks of 16 (the keys inside both)."""
    errors = check_chunks(device, torch.float32, [(16, None), (100, None)], prefill_tilings=(None,),
                          decode_splits=(8,), seed=1)
    _assert_close(errors, 1e-5)
    _assert_close(check_chunks(device, torch.float32, [(16, 10)], decode_splits=(3,), seed=2), 1e-5)


def test_chunks_over_an_fp8_cache(device):
    """A 16-bit model over a scaled fp8 cache: fp16 dots, V read as words on the GPU (head of 48: masked words)."""
    errors = check_chunks(device, torch.float16, [(16, None)], kv_dtype=torch.float8_e4m3fn,
                          scales=KvScales(k=2.5, v=0.3), head_dim=48, decode_splits=(3,), seed=3)
    _assert_close(errors, 1e-3)  # fp16 dots round q, p and the products


@pytest.mark.parametrize("chunk,tiling", [(64, None), (16, DecodeTiling(16, 4, 2, long_block_n=32, long_from=8))])
def test_fused_rotary_decode_with_chunks(device, chunk, tiling):
    """The decode kernel that rotates q and stores the new K/V itself: contexts 64 (a chunk's last token),
    65 (the first: it sees only itself), 200, 130; the second with long steps."""
    errors = check_fused_decode(device.type, torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(1, 3),
                                seed=5, tiling=tiling, chunk=chunk)
    assert errors["cache_differs"] == 0.0 and errors["out_differs"] == 0.0, errors
    assert errors["out_vs_torch"] < 1e-5, errors


GPU_CACHES = [(None, None), (torch.float8_e4m3fn, None), (torch.float8_e4m3fn, (2.5, 0.3))]


@pytest.mark.parametrize("kv_dtype,scales", GPU_CACHES)
def test_chunks_in_bf16_at_llama4_layout_on_gpu(device, kv_dtype, scales):
    """bf16, Llama 4 Scout's attention layout (40 q heads, 8 kv heads, 128 dims), longer contexts and chunks
    of 128 / 1000 (off every tile), the 128 x 128 prefill tiles and the launchers' own, 1-16 splits; the
    fused-rotary decode."""
    if device.type != "cuda":
        pytest.skip("bf16 dots and these sizes: compiled on the GPU only")
    shapes = [(700, 300), (1, 5000), (129, 0), (5, 60), (1, 1000), (1, 1), (128, 0), (300, 1900), (1, 128)]
    errors = check_chunks(device, torch.bfloat16, [(128, None), (1000, None)], shapes, kv_dtype=kv_dtype,
                          scales=KvScales(*scales) if scales else None, heads=40, kv_heads=8, head_dim=128,
                          prefill_tilings=(None, PrefillTiling(128, 128, 8, 3)), decode_splits=(1, 4, 16),
                          granule=128)
    assert errors["prefill"] < 1e-2 and errors["decode"] < 1e-2 and errors["nan"] == 0, errors
    assert errors["effect"] > 0.05, errors
    fused = check_fused_decode("cuda", torch.bfloat16, 40, 8, 128, splits=(1, 4, 16), big=True, kv_dtype=kv_dtype,
                               scales=KvScales(*scales) if scales else None, chunk=128)
    assert fused["cache_differs"] == 0.0 and fused["out_vs_unfused"] < 4e-3, fused
    assert fused["cache_vs_torch"] < 1e-2 and fused["out_vs_torch"] < 1e-2, fused
