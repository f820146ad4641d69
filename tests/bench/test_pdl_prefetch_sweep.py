"""tools/pdl_prefetch_sweep.py: the harness end to end (a CPU dry run), the module setting restored after
it, and bad depths refused before an engine is built."""

import math
import sys
from pathlib import Path

import pytest

import radiance.kernels.w4a8 as w4a8_module
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import pdl_prefetch_sweep  # noqa: E402


def test_dry_run_on_the_cpu_restores_the_depth():
    saved = w4a8_module.PDL_PREFETCH_TILES
    lines = []
    rows = pdl_prefetch_sweep.run("synthetic:llama-3.1-8b", tiles=(3, 0), batches=(1, 2), repeats=2, device="cpu",
                                  overrides={**TINY, "vocab_size": 512}, steps=2, log=lines.append)
    assert [t for t, _ in rows] == [3, 0, 3, 0]
    assert all(len(times) == 2 and all(math.isfinite(t) and t > 0 for t in times) for _, times in rows)
    assert len(lines) == 4 and lines[0].startswith("prefetch  3 tiles")
    assert w4a8_module.PDL_PREFETCH_TILES == saved


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="K tile counts"):
        pdl_prefetch_sweep.run("synthetic:llama-3.1-8b", tiles=(1, -1), device="cpu")
