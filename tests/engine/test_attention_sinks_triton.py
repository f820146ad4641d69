"""gpt-oss's attention options in the Triton kernels (sinks in the prefill normalization and the decode
merges, a sliding window in both kernels) against the torch path (itself checked against HF's eager
attention in test_attention_sinks): on the CPU through the Triton interpreter, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_attention_triton import (_in_interpreter, _same_fp8, check_fused_decode,
                                                check_merge_quantize)

# cache rows below a window are poisoned (NaN) in granules this large: no tile of any tiling reads them
POISON_GRANULE = 128


def _paged_batch(device, dtype, kv_dtype, heads, kv_heads, head_dim, page, shapes, gen):
    """Random caches in kv_dtype with shuffled block tables, and q for sequences of (new, cached) tokens."""
    from radiance.layers.attention import to_cache_dtype

    blocks = sum(-(-(n + c) // page) for n, c in shapes) + 2
    cache = (blocks, page, kv_heads, head_dim)
    k_cache = to_cache_dtype(torch.randn(cache, generator=gen), kv_dtype).to(device)
    v_cache = to_cache_dtype(torch.randn(cache, generator=gen), kv_dtype).to(device)
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(n + c) // page))] for n, c in shapes]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(sum(n for n, _ in shapes), heads, head_dim, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, block_tables


def _poisoned(cache, block_tables, shapes, window):
    """A copy of the cache with NaN in every row of each sequence below its first query's window, rounded
    down to POISON_GRANULE: rows a kernel that skips what lies outside the window never reads."""
    if window is None:
        return cache
    poisoned = cache.clone()
    page = cache.shape[1]
    assert POISON_GRANULE % page == 0  # whole pages
    for table, (_, before) in zip(block_tables.tolist(), shapes):
        for block in table[:max(before + 1 - window, 0) // POISON_GRANULE * POISON_GRANULE // page]:
            poisoned[block] = float("nan")
    return poisoned


def check_sinks_and_window(device: str, dtype: torch.dtype, cases, shapes, kv_dtype=None, scales=None,
                           heads: int = 4, kv_heads: int = 2, head_dim: int = 32, page: int = 16,
                           prefill_tilings=(None,), decode_splits=(1, 3), seed: int = 0) -> dict:
    """For each (window, sinks on) case: paged_prefill_attention over every sequence and
    paged_decode_attention over the one-token ones, against paged_attention_torch on the same cache, whose
    rows outside every window are NaN (_poisoned). Returns the worst relative errors and the number of
    outputs holding a NaN."""
    from radiance.layers import attention_prefill as ap, attention_triton as at
    from radiance.layers.attention import UNIT_SCALES, paged_attention_torch

    gen = torch.Generator().manual_seed(seed)
    scales = scales or UNIT_SCALES
    q, k0, v0, tables = _paged_batch(device, dtype, kv_dtype or dtype, heads, kv_heads, head_dim, page, shapes, gen)
    sinks = (torch.randn(heads, generator=gen) * 2 + 1).to(device)
    q_lens, kv_lens = [n for n, _ in shapes], [n + c for n, c in shapes]
    context_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    decode_rows = cu[:-1][decode].long()
    scale = head_dim ** -0.5
    errors = {"prefill": 0.0, "decode": 0.0, "nan": 0}

    def note(kind, out, ref):
        errors["nan"] += int(torch.isnan(out).any().item())
        errors[kind] = max(errors[kind], ((out.float() - ref).norm() / ref.norm()).item())

    for window, with_sinks in cases:
        options = {"sinks": sinks if with_sinks else None, "sliding_window": window}
        k_cache, v_cache = _poisoned(k0, tables, shapes, window), _poisoned(v0, tables, shapes, window)
        ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), tables, q_lens, kv_lens, scale,
                                    scales=scales, **options)
        for tiling in prefill_tilings:
            note("prefill", ap.paged_prefill_attention(q, k_cache, v_cache, tables, context_lens, cu, max(q_lens),
                                                       scale, scales, tiling=tiling, **options), ref)
        for splits in decode_splits:
            note("decode", at.paged_decode_attention(q[decode_rows], k_cache, v_cache, tables[decode],
                                                     context_lens[decode], scale, splits, kv_scales=scales,
                                                     **options), ref[decode_rows])
    return errors


def merge_against_formula(device: str, dtype: torch.dtype, heads: int = 5, head_dim: int = 24, seed: int = 0) -> float:
    """merge_splits with sinks against the formula in float64: sum_s 2^lse_s acc_s / (sum_s 2^lse_s + e^sink),
    on partials with empty splits and a padding row (all splits empty: zeros). The worst absolute error."""
    from radiance.layers.attention_merge import merge_splits

    gen = torch.Generator().manual_seed(seed)
    batch, splits = 3, 4
    acc = torch.randn(batch, heads, splits, head_dim, generator=gen)
    lse = torch.randn(batch, heads, splits, generator=gen) * 3
    lse[:, ::2, -1] = float("-inf")
    lse[-1] = float("-inf")
    sinks = torch.randn(heads, generator=gen) * 3
    weights = torch.exp2(lse.double())
    total = weights.sum(-1) + torch.exp(sinks.double())[None, :]
    want = (acc.double() * weights[..., None]).sum(2) / total[..., None]
    got = merge_splits(acc.to(device), lse.to(device), dtype, sinks=sinks.to(device))
    return (got.double().cpu() - want).abs().max().item()


_SCRIPT = """
import json, torch
from radiance.layers.attention import KvScales
from radiance.layers.attention_prefill import PrefillTiling
from radiance.layers.attention_triton import DecodeTiling
from tests.engine.test_attention_sinks_triton import check_sinks_and_window, merge_against_formula
from tests.engine.test_attention_triton import check_fused_decode, check_merge_quantize

# fresh prefill, a chunk after 60 tokens, decodes at 70 and 1, a prefill as long as the window of 32, and
# a chunk and a decode at 200 (whose rows below the window are NaN)
shapes = [(37, 0), (5, 60), (1, 70), (1, 1), (16, 16), (20, 200), (1, 200)]
cases = [(1, True), (7, False), (32, True), (None, True), (400, True)]
small = PrefillTiling(16, 16)  # tiles of 16 skip most of what lies below a window
results = {
    "fp32": check_sinks_and_window("cpu", torch.float32, cases, shapes, prefill_tilings=(small,),
                                   decode_splits=(3,)),
    "fp32_default_tiling": check_sinks_and_window("cpu", torch.float32, [(7, True)], shapes, decode_splits=(8,),
                                                  seed=1),
    "fp8_kv_scaled": check_sinks_and_window("cpu", torch.float32, [(7, True)], shapes, kv_dtype=torch.float8_e4m3fn,
                                            scales=KvScales(k=2.5, v=0.3), prefill_tilings=(small,),
                                            decode_splits=(3,), seed=2),
    "fp16_fp8_kv": check_sinks_and_window("cpu", torch.float16, [(7, True)], shapes, kv_dtype=torch.float8_e4m3fn,
                                          prefill_tilings=(small,), decode_splits=(3,), head_dim=48, seed=3),
    "fused": check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(3,), seed=4,
                                sinks=torch.randn(6) * 2, window=50),
    "fused_long_steps": check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(3,),
                                           seed=5, sinks=torch.randn(6) * 2, window=100,
                                           tiling=DecodeTiling(16, 4, 2, long_block_n=32, long_from=20)),
    "merge_quantize": check_merge_quantize("cpu", torch.float16, heads=6, head_dim=32, batches=(3,), splits=(3,),
                                           variants=((None, None), (32, 2)), seed=6, sinks=True, window=30),
    "merge_formula": merge_against_formula("cpu", torch.float32),
}
print(json.dumps(results))
"""


def test_sinks_and_window_in_the_interpreter():
    """Prefill (tiles of 16 and the default tiling) and decode at 1/3/8 splits over fp32, scaled fp8 and
    fp16-over-fp8 caches, windows of 1, 7, 32 (one context's length), 400 (past all) and none; the
    fused-rotary decode (also with long steps); merge_quant_rows (and decode with quantize=True) and
    merge_splits."""
    results = _in_interpreter(_SCRIPT)
    for name in ("fp32", "fp32_default_tiling", "fp8_kv_scaled", "fp16_fp8_kv"):
        errors = results[name]
        tol = 1e-3 if name == "fp16_fp8_kv" else 1e-5  # fp16 dots round q, p and the products
        assert errors["prefill"] < tol and errors["decode"] < tol, (name, errors)
        assert errors["nan"] == 0, (name, errors)
    for name in ("fused", "fused_long_steps"):
        errors = results[name]
        assert errors["cache_differs"] == 0.0 and errors["out_differs"] == 0.0, (name, errors)
        assert errors["out_vs_torch"] < 1e-5, (name, errors)
    merged = results["merge_quantize"]
    assert merged["cases"] > 0 and all(v == 0 for k, v in merged.items() if k != "cases"), merged
    assert results["merge_formula"] < 1e-6


# (kv dtype, calibrated scales of an fp8 cache)
GPU_CACHES = [(None, None), (torch.float8_e4m3fn, None), (torch.float8_e4m3fn, (2.5, 0.3))]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", GPU_CACHES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(64, 8, 64), (16, 2, 128)])
def test_sinks_and_window_on_gpu(heads, kv_heads, head_dim, kv_dtype, scales):
    """gpt-oss's layout (64 q heads, 8 kv heads, 64 dims, window 128) and a wider head, bf16."""
    from radiance.layers.attention import KvScales
    from radiance.layers.attention_prefill import PrefillTiling

    shapes = [(700, 300), (1, 5000), (129, 0), (5, 60), (1, 70), (1, 1), (128, 0), (1, 128)]
    cases = [(128, True), (128, False), (None, True), (1, True), (4000, True)]
    errors = check_sinks_and_window("cuda", torch.bfloat16, cases, shapes, kv_dtype=kv_dtype,
                                    scales=KvScales(*scales) if scales else None, heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, prefill_tilings=(None, PrefillTiling(128, 128, 8, 3)),
                                    decode_splits=(1, 4, 16))
    assert errors["prefill"] < 1e-2 and errors["decode"] < 1e-2, errors
    assert errors["nan"] == 0, errors


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", GPU_CACHES)
def test_fused_rotary_decode_with_sinks_and_window_on_gpu(kv_dtype, scales):
    from radiance.layers.attention import KvScales
    gen = torch.Generator().manual_seed(7)
    errors = check_fused_decode("cuda", torch.bfloat16, 64, 8, 64, splits=(1, 4, 16), big=True, kv_dtype=kv_dtype,
                                scales=KvScales(*scales) if scales else None,
                                sinks=(torch.randn(64, generator=gen) * 2).cuda(), window=128)
    assert errors["cache_differs"] == 0.0 and errors["out_vs_unfused"] < 4e-3, errors
    assert errors["cache_vs_torch"] < 1e-2 and errors["out_vs_torch"] < 1e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("batch,splits,barrier", [(1, 16, True), (2, 4, True), (64, 2, False), (8, 5, False)])
def test_decode_merge_quantize_with_sinks_on_gpu(batch, splits, barrier):
    """Every merge + quantize variant (the barrier kernel, the per-row kernel, merge then quantize past
    ROWS_MAX_SPLITS) writes the bytes of merging with the sinks and then quantizing; merge_splits
    matches the formula; check_merge_quantize's partials, NaN row and end-to-end decode with sinks."""
    from radiance.kernels.activation import quantize_activations
    from radiance.layers import attention_merge as am, attention_triton as at

    gen = torch.Generator().manual_seed(batch)
    heads, kv_heads, dim, page, ctx = 64, 8, 64, 16, 300
    blocks = batch * -(-ctx // page)
    k_cache = torch.randn(blocks, page, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = (torch.randn(blocks, page, kv_heads, dim, generator=gen) * 3).to("cuda", torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).view(batch, -1).to("cuda", torch.int32)
    lens = torch.tensor([ctx - (7 * i) % 280 for i in range(batch)], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, generator=gen).to("cuda", torch.bfloat16)
    sinks = (torch.randn(heads, generator=gen) * 2).cuda()
    assert am.merge_quant_serves(q) == barrier
    args = (q, k_cache, v_cache, tables, lens, dim ** -0.5, splits)
    out = at.paged_decode_attention(*args, sinks=sinks, sliding_window=128)
    fused = at.paged_decode_attention(*args, quantize=True, sinks=sinks, sliding_window=128)
    assert _same_fp8(fused, quantize_activations(out.reshape(batch, heads * dim)))
    assert merge_against_formula("cuda", torch.float32) < 1e-5
    errors = check_merge_quantize("cuda", torch.bfloat16, heads, dim, batches=(batch,), splits=(splits,),
                                  sinks=True, window=128)
    assert errors["cases"] > 0 and all(v == 0 for k, v in errors.items() if k != "cases"), errors
