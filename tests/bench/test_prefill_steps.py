"""tools/prefill_steps.py: shape and variant parsing, and the harness end to end as a CPU dry run."""

import argparse
import math
import sys
from pathlib import Path

import pytest

from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import prefill_steps as ps  # noqa: E402


def test_shapes_and_variants_parse():
    assert ps.shape_requests("1024") == [(1, 1024)] and ps.shape_requests("4x256") == [(4, 256)]
    assert ps.shape_requests("same64x3") == [(-1, 64)] * 3
    for bad in ("x", "0x16", "same64x0", "4x", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="shape"):
            ps.shape_requests(bad)
    assert ps.variant_options("eager") == {"piecewise_graph_tokens": (0,)} and ps.variant_options("piecewise") == {}
    assert ps.variant_options("piecewise:2048")["piecewise_graph_tokens"][-2:] == (1536, 2048)
    with pytest.raises(argparse.ArgumentTypeError, match="variant"):
        ps.variant_options("graphs")


def test_dry_run_on_the_cpu():
    """Each variant's engine, each shape's steps timed: one step for a new prompt within the budget, one per repeat of
    a shared prompt (prefix hits after the first)."""
    lines = []
    results = ps.run("synthetic:llama-3.1-8b", "none", ["eager", "piecewise"], ["24", "2x8", "same32x2"],
                     max_num_seqs=4, device="cpu", overrides={**TINY, "vocab_size": 512}, warm_up=16, log=lines.append)
    assert sorted(results) == sorted((v, s) for v in ("eager", "piecewise") for s in ("24", "2x8", "same32x2"))
    assert [len(results["eager", s]) for s in ("24", "2x8", "same32x2")] == [1, 1, 2]
    assert all(len(t) >= 1 and all(math.isfinite(ms) and ms > 0 for ms in t)
               for runs in results.values() for t in runs)
    assert lines[0].startswith("eager: engine built in") and lines[0].endswith("piecewise buckets None")
    assert sum(" same32x2: " in line for line in lines) == 4
