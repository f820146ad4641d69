"""tools/cpu_attention_bench.py: its three variants run the engine's attention function and agree (same
values in every cache), so the timings compare like with like."""

import sys
from pathlib import Path

import torch

from radiance.layers.attention import paged_attention_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import cpu_attention_bench as bench  # noqa: E402


def test_variants_hold_the_same_context_and_give_the_same_output():
    gen = torch.Generator().manual_seed(0)
    context = 40
    table = torch.arange(bench.FIRST_BLOCK, bench.FIRST_BLOCK + 3, dtype=torch.int32).unsqueeze(0)
    q = torch.randn(1, bench.HEADS, bench.DIM).to(torch.bfloat16)
    outs = [paged_attention_torch(q, cache[0, 3], cache[1, 3], table, [1], [context], 0.125, first)
            for cache, first in bench.variants(context, gen).values()]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_run_reports_every_variant():
    lines = []
    results = bench.run(contexts=(20,), rounds=2, log=lines.append)
    assert len(results) == 3 == len(lines)
    assert all(0 < lo <= med for lo, med in results.values())
