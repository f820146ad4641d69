"""Triton paged attention against the torch SDPA reference: on the GPU, and on the CPU through the
Triton interpreter (small shapes, in a subprocess since TRITON_INTERPRET is read at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def check_kernels(device: str, dtype: torch.dtype, head_dim: int = 64, heads: int = 8, kv_heads: int = 2,
                  page: int = 16, seed: int = 0, big: bool = False) -> dict[str, float]:
    """Random paged caches with shuffled block tables; returns the worst relative error per kernel."""
    from radiance.layers import attention_triton as at
    from radiance.layers.attention import paged_attention_torch, store_kv_cache_torch

    gen = torch.Generator().manual_seed(seed)
    # (new tokens, cached tokens before them) per sequence: fresh prefill, chunk after context, decode
    shapes = [(37, 0), (5, 20), (1, 70), (16, 16), (1, 1)]
    if big:
        shapes += [(700, 300), (1, 5000), (129, 0)]
    num_blocks = sum(-(-(q + c) // page) for q, c in shapes) + 4
    cache_shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
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
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    context_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    scale = head_dim ** -0.5

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_cache_torch(k, v, ref_k, ref_v, slot_mapping)
    # padding rows (slot -1) must write nothing
    pad = torch.full((2,), -1, dtype=torch.int64, device=device)
    at.store_kv_cache(torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), k_cache, v_cache, torch.cat([slot_mapping, pad]))
    errors = {"store": max((k_cache.float() - ref_k.float()).abs().max().item(),
                           (v_cache.float() - ref_v.float()).abs().max().item())}

    ref = paged_attention_torch(q.float(), ref_k.float(), ref_v.float(), block_tables, q_lens, kv_lens, scale)
    out = at.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu, max(q_lens), scale)
    errors["prefill"] = ((out.float() - ref).norm() / ref.norm()).item()

    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    rows = cu[:-1][decode_rows].long()
    ref_d = ref[rows]
    worst = 0.0
    for splits in (1, 3, 8):
        out_d = at.paged_decode_attention(q[rows], k_cache, v_cache, block_tables[decode_rows],
                                          context_lens[decode_rows], scale, splits)
        worst = max(worst, ((out_d.float() - ref_d).norm() / ref_d.norm()).item())
    errors["decode"] = worst
    # a graph bucket's padding row: context 0 gives zeros, not NaN
    padded = at.paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1],
                                       torch.zeros(1, dtype=torch.int32, device=device), scale, 4)
    errors["padding_nan"] = float(torch.isnan(padded).any().item())
    return errors


_SCRIPT = """
import json, torch
from tests.engine.test_attention_triton import check_kernels
print(json.dumps(check_kernels("cpu", torch.float32, head_dim=48, heads=6, kv_heads=2)))
"""


def test_triton_kernels_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["store"] == 0.0
    assert errors["prefill"] < 1e-4 and errors["decode"] < 1e-4
    assert errors["padding_nan"] == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 32, 8), (128, 16, 2)])
def test_triton_kernels_on_gpu(head_dim, heads, kv_heads):
    errors = check_kernels("cuda", torch.bfloat16, head_dim, heads, kv_heads, big=True)
    assert errors["store"] == 0.0
    assert errors["prefill"] < 1e-2 and errors["decode"] < 1e-2, errors
    assert errors["padding_nan"] == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,splits", [(1, 32, 8, 128, 32), (3, 32, 8, 128, 8),
                                                                  (2, 14, 2, 64, 1)])
def test_decode_merge_quantize_matches_merge_then_quantize(batch, heads, kv_heads, head_dim, splits):
    """The fused merge + fp8 quantization (o_proj's input at decode) writes the bytes of merging to
    bf16 and then quantizing; a NaN in one sequence changes only that sequence; the barrier's
    counters are re-armed for every launch, CUDA-graph replays included."""
    from radiance.kernels.activation import quantize_activations
    from radiance.layers import attention_triton as at

    gen = torch.Generator().manual_seed(1)
    page, ctx = 16, 300
    blocks = batch * -(-ctx // page)
    k_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = (torch.randn(blocks, page, kv_heads, head_dim, generator=gen) * 3).to("cuda", torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).view(batch, -1).to("cuda", torch.int32)
    lens = torch.tensor([ctx - 7 * i for i in range(batch)], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=gen).to("cuda", torch.bfloat16)

    def unfused(q):
        out = at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, splits)
        return quantize_activations(out.reshape(batch, heads * head_dim))

    def fused(q):
        return at.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, splits, quantize=True)

    def same(a, b):
        return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

    assert at._merge_quant_serves(q)
    ref = unfused(q)
    for _ in range(3):
        assert same(fused(q), ref)
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
        assert same(captured, unfused(fresh))
