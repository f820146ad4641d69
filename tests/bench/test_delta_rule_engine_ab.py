"""tools/delta_rule_engine_ab.py: forms parse as the sweep's, a form reaches the hybrid layers' delta rule, the
table."""

import sys
from pathlib import Path

import pytest

import radiance.models.qwen3_5 as qwen3_5
from radiance.kernels._triton.gated_delta_chunked import chunked_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import delta_rule_engine_ab as ab  # noqa: E402


def test_forms_parse_as_the_sweeps_and_served_means_the_defaults():
    assert ab.parse_form("served") == ("served", {})
    label, kwargs = ab.parse_form("32:64/tf32x3:tf32x3/4:8/doubling")
    assert label == "32:64/tf32x3:tf32x3/4:8/doubling"
    assert kwargs["inverse"] == "doubling" and kwargs["output_precision"] == "tf32x3" and kwargs["scan_warps"] == 8
    with pytest.raises(ValueError):
        ab.parse_form("32/tf32x3/4")


def test_a_form_reaches_the_hybrid_layers_delta_rule(monkeypatch):
    monkeypatch.setattr(qwen3_5, "chunked_prefill", chunked_prefill)  # restored after the test
    ab.serve_form(ab.parse_form("32:64/tf32x3/4:8/refined")[1])
    assert qwen3_5.chunked_prefill.func is chunked_prefill
    assert qwen3_5.chunked_prefill.keywords["inverse"] == "refined"
    ab.serve_form({})
    assert qwen3_5.chunked_prefill.keywords == {}


def test_the_table_has_a_row_per_form_and_every_rounds_number():
    rows = {("served", 1024): [29071.4, 29341.0], ("served", 8192): [35986.0, 36243.2],
            ("old", 1024): [26000.0, 26100.0], ("old", 8192): [32000.0, 32080.0]}
    text = ab.table(rows, ["served", "old"], [1024, 8192])
    assert text.splitlines() == ["| form | prefill tok/s @1024 | prefill tok/s @8192 |", "|---|---|---|",
                                 "| served | 29,071 / 29,341 | 35,986 / 36,243 |",
                                 "| old | 26,000 / 26,100 | 32,000 / 32,080 |"]
