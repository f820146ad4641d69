"""Triton paged attention against the torch SDPA reference: on the GPU, and on the CPU through the
Triton interpreter (small shapes, in a subprocess since TRITON_INTERPRET is read at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def check_kernels(device: str, dtype: torch.dtype, head_dim: int = 64, heads: int = 8, kv_heads: int = 2,
                  page: int = 16, seed: int = 0, big: bool = False, kv_dtype: torch.dtype | None = None,
                  scales=None, softcap: float | None = None) -> dict[str, float]:
    """Random paged caches with shuffled block tables; returns the worst relative error per kernel. The
    cache in `kv_dtype` (default: the model's dtype; fp8: rows of K/V up to 600 x scales.k, past e4m3's 448,
    stored against `scales`, an attention.KvScales).
    "store_ulps": the largest difference between the Triton and torch stores of normal fp8 values in units
    of their last place, "store_subnormal" the largest among subnormals (0 = the same bytes); attention is checked against the torch reference over the cache the
    Triton store wrote. `softcap`: the logits soft-capped (Gemma 2) everywhere; "cap_effect" how far the capped
    reference lies from the uncapped one."""
    from radiance.layers import attention_prefill as ap, attention_triton as at
    from radiance.layers.attention import UNIT_SCALES, paged_attention_torch, store_kv_cache_torch, to_cache_dtype

    scales = scales or UNIT_SCALES
    gen = torch.Generator().manual_seed(seed)
    # (new tokens, cached tokens before them) per sequence: fresh prefill, chunk after context, decode
    # (70, 130): the prefill kernel's unmasked tiles below the q tile's first query, then its diagonal ones
    shapes = [(37, 0), (5, 20), (1, 70), (16, 16), (1, 1), (70, 130)]
    if big:
        shapes += [(700, 300), (1, 5000), (129, 0)]
    num_blocks = sum(-(-(q + c) // page) for q, c in shapes) + 4
    cache_shape = (num_blocks, page, kv_heads, head_dim)
    kv_dtype = kv_dtype or dtype
    k_cache = to_cache_dtype(torch.randn(cache_shape, generator=gen), kv_dtype).to(device)
    v_cache = to_cache_dtype(torch.randn(cache_shape, generator=gen), kv_dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, q_lens, kv_lens = [], [], [], []
    for q_len, before in shapes:
        n = -(-(q_len + before) // page)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // page] * page + p % page for p in range(before, before + q_len)]
        q_lens.append(q_len)
        kv_lens.append(before + q_len)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(device, dtype)
    if kv_dtype == torch.float8_e4m3fn:  # a few values past e4m3's range: both stores saturate
        k[0, 0, :4] = (torch.tensor([600.0, -600.0, 447.0, 1e-3]) * scales.k).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    context_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_cache_torch(k, v, ref_k, ref_v, slot_mapping, scales=scales)
    # padding rows (slot -1) must write nothing
    pad = torch.full((2,), -1, dtype=torch.int64, device=device)
    ap.store_kv_cache(torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), k_cache, v_cache, torch.cat([slot_mapping, pad]),
                      scales)
    errors = {"store": max((k_cache.float() - ref_k.float()).abs().max().item(),
                           (v_cache.float() - ref_v.float()).abs().max().item())}
    if kv_dtype == torch.float8_e4m3fn:  # one place of a normal e4m3 value: 2^(exponent - 3)
        errors["store_ulps"] = errors["store_subnormal"] = 0.0
        for a, b in ((k_cache.float(), ref_k.float()), (v_cache.float(), ref_v.float())):
            normal = b.abs() >= 2**-6
            place = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=2**-6))) - 3)
            errors["store_ulps"] = max(errors["store_ulps"], ((a - b).abs() / place)[normal].max().item())
            errors["store_subnormal"] = max(errors["store_subnormal"], (a - b).abs()[~normal].max().item())
        errors["saturated"] = float(k_cache[slots[0] // page, slots[0] % page, 0, :2].float().abs().tolist() == [448.0] * 2)

    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), block_tables, q_lens, kv_lens, scale,
                                scales=scales, softcap=softcap)
    if softcap is not None:
        plain = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), block_tables, q_lens, kv_lens,
                                      scale, scales=scales)
        errors["cap_effect"] = ((plain - ref).norm() / ref.norm()).item()
    errors["prefill"] = 0.0
    # the default tiling, and the one a context past 4k tokens picks (128 x 128 tiles for 16-bit dots)
    for max_kv_len in (None, 1 << 20):
        out = ap.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu, max(q_lens), scale, scales,
                                         max_kv_len=max_kv_len, softcap=softcap)
        errors["prefill"] = max(errors["prefill"], ((out.float() - ref).norm() / ref.norm()).item())
    # into a given buffer longer than the step (the piecewise graphs' static output): the same values in the
    # step's rows, the rows past them untouched
    given = torch.full((q.shape[0] + 3, *q.shape[1:]), float("nan"), dtype=q.dtype, device=device)
    into = ap.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu, max(q_lens), scale, scales,
                                      max_kv_len=max_kv_len, out=given, softcap=softcap)
    errors["prefill_out"] = float(into.data_ptr() != given.data_ptr() or not torch.equal(given[:q.shape[0]], out)
                                  or not torch.isnan(given[q.shape[0]:]).all().item())

    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    rows = cu[:-1][decode_rows].long()
    ref_d = ref[rows]
    worst = 0.0
    # the default tiling at each split count, and each tiling decode_tiling picks at one split count
    # (the second switches to 64-row steps where a split's share reaches 16 tokens: both loops run)
    tilings = [at.DecodeTiling(64, 4, 3), at.DecodeTiling(32, 4, 2, long_block_n=64, long_from=16),
               at.DecodeTiling(128, 4, 2)]
    for splits, tiling in [(1, None), (3, None), (8, None)] + [(3, t) for t in tilings]:
        out_d = at.paged_decode_attention(q[rows], k_cache, v_cache, block_tables[decode_rows],
                                          context_lens[decode_rows], scale, splits, tiling=tiling, kv_scales=scales,
                                          softcap=softcap)
        worst = max(worst, ((out_d.float() - ref_d).norm() / ref_d.norm()).item())
    errors["decode"] = worst
    # a graph bucket's padding row: context 0 gives zeros, not NaN
    padded = at.paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1],
                                       torch.zeros(1, dtype=torch.int32, device=device), scale, 4)
    errors["padding_nan"] = float(torch.isnan(padded).any().item())
    return errors


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _same_fp8(a: tuple, b: tuple) -> bool:
    """Two (x_q, x_scale) pairs hold the same bytes."""
    return _same_bytes(a[0], b[0]) and _same_bytes(a[1], b[1])


def check_fused_decode(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       splits: tuple[int, ...], big: bool = False, page: int = 16, seed: int = 0,
                       kv_dtype: torch.dtype | None = None, tiling=None, scales=None, sinks=None,
                       window: int | None = None, chunk: int | None = None, rotary_dim: int | None = None) -> dict:
    """paged_decode_attention(rotary=...) (rotary and KV store inside the split kernel) against
    RotaryEmbedding.rotate_and_store + paged_decode_attention (the unfused launches) and against the
    torch reference (_rotate + store_kv_cache_torch + paged_attention_torch). Shuffled multi-page
    tables; contexts of 1 token, on a BLOCK_N boundary and just past it; a padding row (slot -1)
    whose context covers another sequence's blocks; q, k, v strided views of one qkv row. `sinks` and
    `window` (gpt-oss), and Llama 4's attention `chunk`, go to every path; `rotary_dim` (GLM-4.5: half the head)
    rotates each head's leading dims only."""
    from radiance.layers import attention_triton as at
    from radiance.layers.attention import UNIT_SCALES, paged_attention_torch, store_kv_cache_torch, to_cache_dtype
    from radiance.layers.rotary import RotaryEmbedding, _rotate

    scales = scales or UNIT_SCALES

    gen = torch.Generator().manual_seed(seed)
    contexts = [1, 64, 65, 200, 130] + ([5000, 1000, 129] if big else [])  # new token included
    rope = RotaryEmbedding(head_dim, 8192, 10000.0, rotary_dim=rotary_dim).to(device)
    blocks = sum(-(-n // page) for n in contexts) + 2
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // page))] for n in contexts]
    slots = [t[(n - 1) // page] * page + (n - 1) % page for t, n in zip(tables, contexts)]
    tables.append(tables[3])  # padding row: writes nothing, output ignored
    contexts.append(40)
    slots.append(-1)
    batch, width = len(contexts), max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    positions = torch.tensor(contexts, dtype=torch.int64, device=device) - 1
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = (x.view(batch, -1, head_dim) for x in
               qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))
    cache = (blocks, page, kv_heads, head_dim)
    k0 = to_cache_dtype(torch.randn(cache, generator=gen), kv_dtype or dtype).to(device)
    v0 = to_cache_dtype(torch.randn(cache, generator=gen), kv_dtype or dtype).to(device)
    scale = head_dim ** -0.5
    real = slice(0, batch - 1)

    ref_k, ref_v = k0.clone(), v0.clone()  # the torch reference
    cos, sin = rope.cos[positions].unsqueeze(-2), rope.sin[positions].unsqueeze(-2)
    store_kv_cache_torch(_rotate(k, cos, sin), v, ref_k, ref_v, slot_mapping, scales=scales)
    ref = paged_attention_torch(_rotate(q, cos, sin).float()[real], ref_k.float(), ref_v.float(), block_tables,
                                [1] * (batch - 1), contexts[:-1], scale, scales=scales, sinks=sinks,
                                sliding_window=window, attention_chunk=chunk)
    unf_k, unf_v = k0.clone(), v0.clone()  # the unfused launches
    q_rot = rope.rotate_and_store(positions, q, k, v, unf_k, unf_v, slot_mapping, scales)
    errors = {"cache_vs_torch": ((unf_k.float() - ref_k.float()).norm() / ref_k.float().norm()).item(),
              "cache_differs": 0.0, "out_differs": 0.0, "out_vs_unfused": 0.0, "out_vs_torch": 0.0}
    for n in splits:
        unfused = at.paged_decode_attention(q_rot, unf_k, unf_v, block_tables, context_lens, scale, n, tiling=tiling,
                                            kv_scales=scales, sinks=sinks, sliding_window=window,
                                            attention_chunk=chunk)
        k_cache, v_cache = k0.clone(), v0.clone()
        out = at.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, n,
                                        rotary=(rope.cos, rope.sin, positions, k, v, slot_mapping), tiling=tiling,
                                        kv_scales=scales, sinks=sinks, sliding_window=window, attention_chunk=chunk)
        errors["cache_differs"] += float(not (_same_bytes(k_cache, unf_k) and _same_bytes(v_cache, unf_v)))
        errors["out_differs"] += float(not _same_bytes(out[real], unfused[real]))
        diff = ((out[real].float() - unfused[real].float()).norm() / unfused[real].float().norm()).item()
        errors["out_vs_unfused"] = max(errors["out_vs_unfused"], diff)
        err = ((out[real].float() - ref).norm() / ref.norm()).item()
        errors["out_vs_torch"] = max(errors["out_vs_torch"], err)
    return errors


def check_merge_quantize(device: str, dtype: torch.dtype, heads: int, head_dim: int, batches=(1, 3, 5),
                         splits=(1, 3), variants=((None, None), (128, None), (32, 2)), seed: int = 0,
                         sinks: bool = False, window: int | None = None) -> dict:
    """The per-row merge + quantize (attention_merge.merge_quant_rows: what W4A8 decode runs past the barrier
    kernel's batches, and under the interpreter) against merge then quantize (_merge ->
    quantize_activations), on random split partials: rows scaled 1e-2 .. 1e2 apart, empty splits
    (lse -inf), a padding row (every split empty); each (tile, split group) in `variants` (None: the
    launcher's; small tiles force the two-pass chunked path, 6 heads in chunks of 4 + 2 or of 1; a
    small split group the loop over groups of splits and its tail). Then a NaN planted in one
    sequence's partials; then paged_decode_attention(quantize=True) end to end. Counts mismatches.
    With `sinks` every merge gets random sink logits (gpt-oss), and the end-to-end decode `window`."""
    from radiance.kernels.activation import quantize_activations
    from radiance.layers import attention_merge as am, attention_triton as at

    gen = torch.Generator().manual_seed(seed)
    errors = {"differs": 0, "nan_differs": 0, "nan_leaks": 0, "nan_missing": 0, "paged_differs": 0, "cases": 0}
    sink_logits = (torch.randn(heads, generator=gen) * 2).to(device) if sinks else None
    for batch in batches:
        for n in splits:
            rows = 10.0 ** torch.linspace(-2, 2, batch)
            acc = torch.randn(batch, heads, n, head_dim, generator=gen) * rows[:, None, None, None]
            lse = torch.randn(batch, heads, n, generator=gen) * 4
            if n > 1:  # a split past some heads' context
                lse[:, ::2, -1] = float("-inf")
                acc[:, ::2, -1] = 0.0
            if batch > 1:  # a graph bucket's padding row
                lse[-1] = float("-inf")
                acc[-1] = 0.0
            acc, lse = acc.to(device), lse.to(device)
            ref = quantize_activations(am.merge_splits(acc, lse, dtype, sinks=sink_logits).reshape(batch, -1))
            for tile, group in variants:
                got = am.merge_quant_rows(acc, lse, dtype, tile=tile or am.ROW_TILE, split_group=group,
                                          sinks=sink_logits)
                errors["differs"] += int(not _same_fp8(got, ref))
                errors["cases"] += 1
            if batch > 1:
                bad = acc.clone()
                bad[1, heads - 1, n - 1, 3] = float("nan")
                bad_ref = quantize_activations(am.merge_splits(bad, lse, dtype, sinks=sink_logits).reshape(batch, -1))
                others = [i for i in range(batch) if i != 1]
                for tile, group in variants:
                    x_q, x_scale = am.merge_quant_rows(bad, lse, dtype, tile=tile or am.ROW_TILE, split_group=group,
                                                       sinks=sink_logits)
                    errors["nan_differs"] += int(not _same_fp8((x_q, x_scale), bad_ref))
                    errors["nan_missing"] += int(not torch.isnan(x_scale[1]).all().item())
                    errors["nan_leaks"] += int(not (_same_bytes(x_q[others], ref[0][others])
                                                    and _same_bytes(x_scale[others], ref[1][others])))
    # end to end: the split kernel, then (quantize=True) the per-row merge + quantize
    page, kv_heads = 16, 2 if heads % 2 == 0 else 1
    contexts = [1, 40, 77, 0]  # the last a padding row
    tables = torch.randperm(32, generator=gen)[:4 * 6].view(4, 6).to(device, torch.int32)
    k_cache = torch.randn(32, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = (torch.randn(32, page, kv_heads, head_dim, generator=gen) * 3).to(device, dtype)
    q = torch.randn(len(contexts), heads, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    for n in splits:
        options = {"sinks": sink_logits, "sliding_window": window}
        out = at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, n, **options)
        got = at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, n, quantize=True,
                                        **options)
        errors["paged_differs"] += int(not _same_fp8(got, quantize_activations(out.reshape(len(contexts), -1))))
    return errors


def _in_interpreter(script: str) -> dict:
    """Runs `script` under TRITON_INTERPRET=1 in a subprocess (Triton reads it at import) and returns
    the JSON object its last line prints."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_SCRIPT = """
import json, torch
from tests.engine.test_attention_triton import check_kernels
fp32 = check_kernels("cpu", torch.float32, head_dim=48, heads=6, kv_heads=2)
fp8_kv = check_kernels("cpu", torch.float32, head_dim=48, heads=6, kv_heads=2, kv_dtype=torch.float8_e4m3fn, seed=1)
from radiance.layers.attention import KvScales
scaled = check_kernels("cpu", torch.float32, head_dim=48, heads=6, kv_heads=2, kv_dtype=torch.float8_e4m3fn, seed=2,
                       scales=KvScales(k=2.5, v=0.3))
# a 16-bit model over an fp8 cache: fp16 dots, V read as words (a head of 48 leaves 4 of 16 words masked)
fp16_fp8_kv = check_kernels("cpu", torch.float16, head_dim=48, heads=6, kv_heads=2, kv_dtype=torch.float8_e4m3fn,
                            seed=3, scales=KvScales(k=2.5, v=0.3))
# Gemma 2's soft-capped logits, the cap well inside the logits' range so that it changes the result
capped = check_kernels("cpu", torch.float32, head_dim=48, heads=6, kv_heads=2, seed=4, softcap=0.5)
print(json.dumps({"fp32": fp32, "fp8_kv": fp8_kv, "fp8_kv_scaled": scaled, "fp16_fp8_kv": fp16_fp8_kv,
                  "softcap": capped}))
"""


def test_decode_tiling_follows_the_grid():
    """Splits of 512 tokens or more step 128 cache rows at a time while the programs fit two per SM
    (batch 1 at long context); 64 rows otherwise, 32 for heads above 128. Over an fp8 cache read as
    words, splits of 256 tokens step 128 rows three deep while the programs fit three per SM."""
    from radiance.layers.attention_triton import DecodeTiling, decode_tiling
    assert decode_tiling(128, programs=8 * 32, sms=132) == DecodeTiling(64, 4, 2, long_block_n=128, long_from=512)
    assert decode_tiling(128, programs=2 * 8 * 17, sms=132) == DecodeTiling(64, 4, 2)
    assert decode_tiling(256, programs=8, sms=132) == DecodeTiling(32, 4, 2)
    fp8_long = DecodeTiling(64, 4, 2, long_block_n=128, long_from=256, long_stages=3)
    assert decode_tiling(128, programs=16 * 8 * 3, sms=132, fp8_cache=True) == fp8_long
    assert decode_tiling(128, programs=64 * 8, sms=132, fp8_cache=True) == DecodeTiling(64, 4, 2)
    assert decode_tiling(256, programs=8, sms=132, fp8_cache=True) == DecodeTiling(32, 4, 2)
    for fp8 in (False, True):  # Ada's 99 KiB of shared memory: 64-row steps only
        assert decode_tiling(128, programs=8 * 32, sms=128, fp8_cache=fp8, large_smem=False) == DecodeTiling(64, 4, 2)


def test_prefill_tiling_follows_the_context():
    """128-row cache steps three deep over an fp8 cache; 128 x 128 tiles, 8 warps, over a 16-bit cache from 4k
    tokens of context; the 64 x 64 default below that, without Hopper's shared memory, or for heads above 128;
    16 q rows for a few tokens."""
    from radiance.layers.attention_prefill import PrefillTiling, prefill_tiling
    assert prefill_tiling(128, max_q_len=2048, max_kv_len=2048, fp8_dots=False) == PrefillTiling(64, 64, 4, 2)
    assert prefill_tiling(128, max_q_len=512, max_kv_len=4096, fp8_dots=False) == PrefillTiling(128, 128, 8, 3)
    assert prefill_tiling(128, max_q_len=512, max_kv_len=100, fp8_dots=True) == PrefillTiling(64, 128, 4, 3)
    assert prefill_tiling(128, max_q_len=512, max_kv_len=1 << 15, fp8_dots=True, large_smem=False) == PrefillTiling()
    assert prefill_tiling(256, max_q_len=512, max_kv_len=1 << 15, fp8_dots=False) == PrefillTiling(64, 32, 4, 2)
    assert prefill_tiling(64, max_q_len=8, max_kv_len=1 << 15, fp8_dots=True) == PrefillTiling(16, 64, 4, 2)


def test_triton_kernels_in_the_interpreter():
    results = _in_interpreter(_SCRIPT)
    errors = results["fp32"]
    assert errors["store"] == 0.0
    assert errors["prefill"] < 1e-4 and errors["decode"] < 1e-4
    assert errors["padding_nan"] == 0.0 and errors["prefill_out"] == 0.0
    for fp8 in (results["fp8_kv"], results["fp8_kv_scaled"], results["fp16_fp8_kv"]):  # scaled: K / 2.5, V / 0.3
        # the interpreter rounds ties away from zero (one place) and flushes subnormals
        assert fp8["store_ulps"] <= 1.0 and fp8["store_subnormal"] < 2**-6 and fp8["saturated"] == 1.0, fp8
        tol = 1e-3 if fp8 is results["fp16_fp8_kv"] else 1e-4  # fp16 dots round q, p and the products
        assert fp8["prefill"] < tol and fp8["decode"] < tol and fp8["padding_nan"] == 0.0, fp8
    capped = results["softcap"]
    assert capped["cap_effect"] > 0.05, capped  # the cap matters, so the kernels' match depends on applying it
    assert capped["prefill"] < 1e-4 and capped["decode"] < 1e-4 and capped["padding_nan"] == 0.0, capped


_FUSED_SCRIPT = """
import json, torch
from tests.engine.test_attention_triton import check_fused_decode
fp32 = check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(1, 3, 8))
fp16 = check_fused_decode("cpu", torch.float16, heads=8, kv_heads=2, head_dim=64, splits=(2,), seed=1)
fp8_kv = check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(1, 3), seed=2,
                            kv_dtype=torch.float8_e4m3fn)
from radiance.layers.attention_triton import DecodeTiling
long_steps = check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(1, 3), seed=3,
                                tiling=DecodeTiling(32, 4, 2, long_block_n=64, long_from=40))
from radiance.layers.attention import KvScales
fp8_kv_scaled = check_fused_decode("cpu", torch.float32, heads=6, kv_heads=2, head_dim=32, splits=(1, 3), seed=4,
                                   kv_dtype=torch.float8_e4m3fn, scales=KvScales(k=0.07, v=3.0))
print(json.dumps({"fp32": fp32, "fp16": fp16, "fp8_kv": fp8_kv, "long_steps": long_steps,
                  "fp8_kv_scaled": fp8_kv_scaled}))
# (the interpreter's bf16 dots are not usable)
"""


def test_fused_rotary_decode_in_the_interpreter():
    """Rotary + KV store inside the decode split kernel: the cache bytes and the output equal the
    unfused launches' (rotate_and_store, then decode), the output close to the torch reference."""
    results = _in_interpreter(_FUSED_SCRIPT)
    for dtype, errors in results.items():
        assert errors["cache_differs"] == 0.0 and errors["out_differs"] == 0.0, (dtype, errors)
        tol = 1e-5 if dtype in ("fp32", "long_steps") else 1e-3
        if dtype.startswith("fp8_kv"):  # the same bytes as the torch store, so the same attention output
            assert errors["cache_vs_torch"] == 0.0 and errors["out_vs_torch"] < 1e-5, errors
            continue
        assert errors["cache_vs_torch"] < tol and errors["out_vs_torch"] < tol, (dtype, errors)


_MERGE_QUANT_SCRIPT = """
import json, torch
from tests.engine.test_attention_triton import check_merge_quantize
fp32 = check_merge_quantize("cpu", torch.float32, heads=6, head_dim=32, splits=(1, 3, 5))
fp16 = check_merge_quantize("cpu", torch.float16, heads=6, head_dim=32, seed=1)
fp16_pad = check_merge_quantize("cpu", torch.float16, heads=3, head_dim=48, batches=(2,), splits=(3,), seed=2)
bf16 = check_merge_quantize("cpu", torch.bfloat16, heads=6, head_dim=32, batches=(3,), splits=(3,), seed=3)
print(json.dumps({"fp32": fp32, "fp16": fp16, "fp16_pad": fp16_pad, "bf16": bf16}))
"""


def test_merge_quantize_rows_in_the_interpreter():
    """The per-row decode merge + fp8 quantization writes the bytes of merge then quantize: batches
    1/3/5, splits 1/3, 6 heads (one pass and chunked), a padded head dim; a NaN in one sequence's
    partials gives that row a NaN scale and leaves every other row's bytes alone; and
    paged_decode_attention(quantize=True), which runs it on the CPU, matches its unquantized output."""
    results = _in_interpreter(_MERGE_QUANT_SCRIPT)
    for dtype, errors in results.items():
        assert errors["cases"] > 0, (dtype, errors)
        assert all(v == 0 for k, v in errors.items() if k != "cases"), (dtype, errors)


# (kv dtype, calibrated scales of an fp8 cache)
GPU_CACHES = [(None, None), (torch.float8_e4m3fn, None), (torch.float8_e4m3fn, (2.5, 0.3))]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", GPU_CACHES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 2, 64)])
def test_fused_rotary_decode_on_gpu(heads, kv_heads, head_dim, kv_dtype, scales):
    from radiance.layers.attention import KvScales
    errors = check_fused_decode("cuda", torch.bfloat16, heads, kv_heads, head_dim, splits=(1, 4, 16), big=True,
                                kv_dtype=kv_dtype, scales=KvScales(*scales) if scales else None)
    # the cache bytes are rotate_and_store's; the output may differ from the unfused kernel's in the
    # last bits of a few elements (on the H200 it did at all three split counts, both within 8e-4 of
    # the torch reference), so it is held to the bf16 rounding of the unfused output
    assert errors["cache_differs"] == 0.0 and errors["out_vs_unfused"] < 4e-3, errors
    assert errors["cache_vs_torch"] < 1e-2 and errors["out_vs_torch"] < 1e-2, errors


@pytest.mark.gpu
def test_attention_forward_fuses_rotary_into_decode(monkeypatch):
    """Attention.forward at decode on CUDA, from FUSED_ROTARY_MIN_BATCH sequences on (lowered to the
    test's 3), takes the fused path (rotate_and_store never runs) and leaves the cache and output of
    the prefill path (rotate_and_store + paged prefill) on the same tokens; with `quantize` it still
    returns the merge launch's fp8 activations. Below the threshold it rotates in its own launch."""
    from radiance.kernels.activation import Fp8Activations
    from radiance.layers import attention
    from radiance.layers.attention import Attention, AttentionMetadata
    from radiance.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(attention, "FUSED_ROTARY_MIN_BATCH", 3)

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, page, batch = 32, 8, 128, 16, 3
    rope = RotaryEmbedding(dim, 4096, 500000.0).to("cuda")
    lens = [1, 300, 77]
    tables = torch.randperm(batch * 20, generator=gen).view(batch, 20).to("cuda", torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(lens)],
                         device="cuda")
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = (x.view(batch, -1, dim) for x in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), -1))
    positions = torch.tensor(lens, device="cuda") - 1
    k0 = torch.randn(batch * 20, page, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v0 = torch.randn(k0.shape, generator=gen).to("cuda", torch.bfloat16)
    context = torch.tensor(lens, dtype=torch.int32, device="cuda")
    outs, caches = {}, {}
    for decode in (False, True):
        attn = Attention(heads, kv_heads, dim)
        attn.k_cache, attn.v_cache = k0.clone(), v0.clone()
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=context,
                                 cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                                 q_lens=[1] * batch, kv_lens=lens, is_decode=decode, decode_splits=4)
        if decode:
            monkeypatch.setattr(RotaryEmbedding, "rotate_and_store", lambda *a: pytest.fail("unfused at decode"))
        outs[decode] = attn(q, k, v, meta, rotary=(rope, positions))
        caches[decode] = (attn.k_cache, attn.v_cache)
        if decode:
            attn.k_cache, attn.v_cache = k0.clone(), v0.clone()
            assert isinstance(attn(q, k, v, meta, rotary=(rope, positions), quantize=True), Fp8Activations)
    assert all(_same_bytes(a, b) for a, b in zip(caches[False], caches[True]))
    err = ((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm()).item()
    assert err < 1e-2, err
    monkeypatch.setattr(attention, "FUSED_ROTARY_MIN_BATCH", 4)
    calls = []
    monkeypatch.setattr(RotaryEmbedding, "rotate_and_store", lambda self, pos, q, *a, **kw: calls.append(1) or q)
    attn(q, k, v, meta, rotary=(rope, positions))
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", GPU_CACHES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 32, 8), (128, 16, 2)])
def test_triton_kernels_on_gpu(head_dim, heads, kv_heads, kv_dtype, scales):
    from radiance.layers.attention import KvScales
    errors = check_kernels("cuda", torch.bfloat16, head_dim, heads, kv_heads, big=True, kv_dtype=kv_dtype,
                           scales=KvScales(*scales) if scales else None)
    assert errors["store"] == 0.0  # the Triton store writes the torch store's bytes, fp8 included
    assert errors["prefill"] < 1e-2 and errors["decode"] < 1e-2, errors
    assert errors["padding_nan"] == 0.0 and errors["prefill_out"] == 0.0
    if kv_dtype is not None:
        assert errors["saturated"] == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,splits,barrier", [
    (1, 32, 8, 128, 32, True), (3, 32, 8, 128, 8, True), (2, 14, 2, 64, 1, True),
    (64, 32, 8, 128, 1, False), (64, 32, 8, 128, 2, False), (8, 64, 8, 128, 5, False)])
def test_decode_merge_quantize_matches_merge_then_quantize(batch, heads, kv_heads, head_dim, splits, barrier):
    """The fused merge + fp8 quantization (o_proj's input at decode) writes the bytes of merging to
    bf16 and then quantizing: the barrier kernel while batch * heads fits on the GPU, else the
    per-row kernel (batch 64 x 32 heads) up to ROWS_MAX_SPLITS splits, else the two launches
    (Qwen3-32B's 64 heads at batch 8, 5 splits); a NaN in one sequence
    changes only that sequence; the barrier's counters are re-armed for every launch, and both
    kernels replay in a CUDA graph."""
    from radiance.kernels.activation import quantize_activations
    from radiance.layers import attention_merge as am, attention_triton as at

    gen = torch.Generator().manual_seed(1)
    page, ctx = 16, 300
    blocks = batch * -(-ctx // page)
    k_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = (torch.randn(blocks, page, kv_heads, head_dim, generator=gen) * 3).to("cuda", torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).view(batch, -1).to("cuda", torch.int32)
    lens = torch.tensor([ctx - (7 * i) % 280 for i in range(batch)], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)

    def unfused(q):
        out = at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, splits)
        return quantize_activations(out.reshape(batch, heads * head_dim))

    def fused(q):
        return at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, splits, quantize=True)

    assert am.merge_quant_serves(q) == barrier
    ref = unfused(q)
    for _ in range(3):
        assert _same_fp8(fused(q), ref)
    if batch > 1:
        bad = q.clone()
        bad[1, 3, 5] = float("nan")
        x_q, x_scale = fused(bad)
        assert torch.isnan(x_scale[1]).all()
        others = [i for i in range(batch) if i != 1]
        assert torch.equal(x_q[others].view(torch.uint8), ref[0][others].view(torch.uint8))
    static = q.clone()
    fused(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(static)
    for seed in range(2):
        fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_fp8(captured, unfused(fresh))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (64, 128), (6, 32)])
def test_merge_quantize_rows_on_gpu(heads, head_dim):
    """check_merge_quantize on the GPU in bf16: the per-row kernel's bytes equal merge then quantize
    on random partials (empty splits, a padding row, a NaN), one pass and in chunks of heads."""
    errors = check_merge_quantize("cuda", torch.bfloat16, heads, head_dim, batches=(1, 64), splits=(1, 2, 5, 11),
                                  variants=((None, None), (1024, None), (256, 2)))
    assert errors["cases"] > 0 and all(v == 0 for k, v in errors.items() if k != "cases"), errors
