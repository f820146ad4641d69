"""tools/module_setting_ab.py: setting lookup, value parsing by the current value's type, and the harness end to
end as a CPU dry run (the setting restored after)."""

import math
import sys
from pathlib import Path

import pytest

import radiance.kernels.w4a8 as w4a8
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import module_setting_ab as ab  # noqa: E402


def test_resolve_names_the_setting_or_says_what_is_missing():
    assert ab.resolve("radiance.kernels.w4a8.DEFER_MAX_ROW_BYTES_AT_M1") == (w4a8, "DEFER_MAX_ROW_BYTES_AT_M1")
    with pytest.raises(ValueError, match="no setting 'NOPE'"):
        ab.resolve("radiance.kernels.w4a8.NOPE")
    with pytest.raises(ValueError, match="no module"):
        ab.resolve("radiance.nowhere.NAME")


def test_parse_value_follows_the_current_type():
    assert ab.parse_value(65536, "131072") == 131072 and isinstance(ab.parse_value(1, "2"), int)
    assert ab.parse_value(True, "false") is False
    with pytest.raises(ValueError, match="true or false"):
        ab.parse_value(False, "0")
    assert ab.parse_value(frozenset(), "{'norm'}") == frozenset({"norm"})
    assert ab.parse_value(0.5, "2") == 2.0 and isinstance(ab.parse_value(0.5, "2"), float)
    assert ab.parse_value((1, 2), "[3]") == (3,)


def test_dry_run_on_the_cpu():
    before = w4a8.DEFER_MAX_ROW_BYTES_AT_M1
    lines = []
    rows = ab.run("synthetic:llama-3.1-8b", "radiance.kernels.w4a8.DEFER_MAX_ROW_BYTES_AT_M1", [before, 0],
                  batches=[1, 2], repeats=1, device="cpu", overrides={**TINY, "vocab_size": 512}, steps=2,
                  log=lines.append)
    assert [value for value, _ in rows] == [before, 0]
    assert all(len(t) == 2 and all(math.isfinite(ms) and ms > 0 for ms in t) for _, t in rows)
    assert lines[1].startswith("DEFER_MAX_ROW_BYTES_AT_M1 = 0: batch 1 ")
    assert w4a8.DEFER_MAX_ROW_BYTES_AT_M1 == before
