"""`radiance bench engine` harness, dry-run on the CPU with a tiny synthetic model (timings do not matter)."""

import math
import re

from radiance.bench import engine_bench
from radiance.bench.options import add_engine_parser
from tests.bench.test_bench_synthetic import TINY


def test_engine_bench_rows_have_every_measurement():
    variants = ("none", "mxfp4", "mxfp4+head", "mxfp4+head2", "mxfp4+head2+fp8kv")
    rows = engine_bench.run("synthetic:llama-3.1-8b", variants=variants,
                            contexts=(16, 80), prefills=(24,), concurrencies=(1, 3), with_hf=False, device="cpu",
                            overrides={**TINY, "vocab_size": 512})
    assert [r["variant"] for r in rows] == list(variants)
    for row in rows:
        assert "error" not in row, row.get("error")
        for key in ("decode_ms@16", "decode_ms@80", "prefill_tok_s@24", "agg_tok_s@1", "agg_tok_s@3"):  # 80: 4 chunks
            assert math.isfinite(row[key]) and row[key] > 0, key
    assert any("mxfp4" in line for line in rows[1]["load"])  # the quantized variant really loaded MXFP4 linears
    counts = [int(re.search(r"(\d+) mxfp4", r["load"][1]).group(1)) for r in rows[1:]]
    assert counts[1] == counts[0] + 1  # "+head": the lm_head too
    assert counts[2] == counts[0] and "1 mxfp4x2" in rows[3]["load"][1]  # "+head2": as two MXFP4 terms
    assert "float8_e4m3fn" in rows[4]["load"][-1] and "float8" not in rows[3]["load"][-1]  # "+fp8kv": the cache


def test_engine_bench_cli_takes_model_and_quantization(monkeypatch):
    import argparse

    seen = {}
    monkeypatch.setattr(engine_bench, "run", lambda model, variants, *a, **kw: seen.update(
        model=model, variants=variants, options=kw.get("engine_options")) or [])
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    args = parser.parse_args(["engine", "synthetic:qwen3-32b", "--quantization", "none", "nvfp4"])
    assert args.func(args) == 0
    assert seen == {"model": "synthetic:qwen3-32b", "variants": ("none", "nvfp4"), "options": None}
    args = parser.parse_args(["engine", "--prefill-graphs", "512", "1024"])
    assert args.func(args) == 0
    assert seen["options"] == {"prefill_graph_tokens": (512, 1024)}
    args = parser.parse_args(["engine", "--prefill-graphs", "0"])
    assert args.func(args) == 0
    assert seen["options"] == {"prefill_graph_tokens": (0,)}


def test_busy_time_is_the_union_of_kernel_intervals():
    # nested, overlapping (PDL), touching and disjoint intervals, out of order
    assert engine_bench.busy_us([(5, 9), (0, 4), (1, 2), (3, 6), (9, 10), (20, 21)]) == 11
    assert engine_bench.busy_us([]) == 0


def test_kernel_breakdown_ranks_kernels_per_step():
    # two steps; gemm 10-20 and norm 19-24 overlap (a PDL dependent's wait counts in its own duration)
    records = [("gemm", 0.0, 10.0), ("norm", 9.0, 11.0), ("rope", 11.0, 12.0), ("gemm", 12.0, 24.0),
               ("norm", 30.0, 32.5), ("gemm", 32.5, 43.5)]
    ranked = engine_bench.kernel_breakdown(records, steps=2, top=2)
    assert [r["kernel"] for r in ranked] == ["gemm", "norm"]
    assert ranked[0]["busy_us_per_step"] == 16.5 and ranked[0]["us_per_step"] == 16.5
    assert ranked[0]["calls_per_step"] == 1.5
    assert ranked[1]["busy_us_per_step"] == 1.75 and ranked[1]["us_per_step"] == 2.25
    assert ranked[1]["calls_per_step"] == 1.0
    # a dependent launched early: its wait is the gemm's time, not its own
    late = engine_bench.kernel_breakdown([("gemm", 0.0, 10.0), ("quantize", 1.0, 11.0)], steps=1)
    assert [(r["kernel"], r["busy_us_per_step"], r["us_per_step"]) for r in late] == \
        [("gemm", 10.0, 10.0), ("quantize", 1.0, 10.0)]
    everything = engine_bench.kernel_breakdown(records, steps=1, top=99)
    assert sum(r["busy_us_per_step"] for r in everything) == \
        engine_bench.busy_us([(start, end) for _, start, end in records])
