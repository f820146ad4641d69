"""tools/occupancy_cap_ab.py: the harness end to end (a CPU dry run), the module setting restored after it."""

import math
import sys
from pathlib import Path

import radiance.kernels.w4a8 as w4a8_module
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import occupancy_cap_ab  # noqa: E402


def test_dry_run_on_the_cpu_alternates_and_restores_the_setting():
    saved = w4a8_module.OCCUPANCY_CAP_IN_GRAPHS
    lines = []
    rows = occupancy_cap_ab.run("synthetic:llama-3.1-8b", batches=(1, 2), repeats=2, device="cpu",
                                overrides={**TINY, "vocab_size": 512}, steps=2, log=lines.append)
    assert [on for on, _ in rows] == [False, True, False, True]
    assert all(len(times) == 2 and all(math.isfinite(t) and t > 0 for t in times) for _, times in rows)
    assert lines[0].startswith("cap off: batch 1") and lines[1].startswith("cap on : batch 1")
    assert w4a8_module.OCCUPANCY_CAP_IN_GRAPHS is saved
    table = occupancy_cap_ab.table(rows, (1, 2))
    assert table[0] == "| cap | batch 1 ms | batch 2 ms |" and table[2].startswith("| off | ")
    assert table[3].count("/") == 2  # two alternations per batch
