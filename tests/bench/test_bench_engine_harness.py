"""`radiance bench engine` harness, dry-run on the CPU with a tiny synthetic model (timings do not matter)."""

import argparse
import math
import re

import pytest

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


def test_engine_bench_without_cuda_is_one_error_line(monkeypatch, capsys):
    """Without a GPU every variant used to fail with a logged traceback, an empty table and exit code 0."""
    import torch

    from radiance.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["bench", "engine", "--quantization", "none", "--contexts", "16", "--prefills", "16",
               "--concurrency", "1", "--no-hf"])
    assert rc == 2
    captured = capsys.readouterr()
    assert "CUDA" in captured.err and "Traceback" not in captured.err + captured.out


def test_engine_bench_exit_code_says_a_variant_failed(monkeypatch):
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    rows = [{"variant": "none", "decode_ms@128": 5.0}, {"variant": "mxfp4", "error": "RuntimeError: out of memory"}]
    monkeypatch.setattr(engine_bench, "run", lambda *a, **kw: rows)
    args = parser.parse_args(["engine"])
    assert args.func(args) == 1
    monkeypatch.setattr(engine_bench, "run", lambda *a, **kw: rows[:1])
    assert args.func(args) == 0


@pytest.mark.parametrize("argv", [["--contexts", "0"], ["--contexts", "-4"], ["--prefills", "0"],
                                  ["--concurrency", "0"], ["--concurrency", "x"]])
def test_engine_bench_sizes_must_be_positive(argv, capsys):
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["engine"] + argv)
    assert "expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["synthetic:nope"], "unknown synthetic model"),
    (["./my-checkpoint"], "unknown synthetic model"),
    (["--quantization", "int4"], "quantization"),
    (["--quantization", "none+head"], "quantize_lm_head"),
    (["--quantization", "mxfp4+fp8"], "quantization"),
    (["--json", "/no/such/dir/rows.json"], "/no/such/dir"),
    (["--plot", "/no/such/dir/rows.png"], "/no/such/dir"),
])
def test_engine_bench_arguments_fail_before_any_model_is_built(monkeypatch, capsys, argv, message):
    from radiance.cli import main

    ran = []
    monkeypatch.setattr(engine_bench, "run", lambda *a, **kw: ran.append(a) or [])
    assert main(["bench", "engine"] + argv) == 2 and not ran
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
