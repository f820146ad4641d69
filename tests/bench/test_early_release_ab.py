"""tools/early_release_ab.py: variant parsing, and the harness end to end as a CPU dry run (the switch restored)."""

import math
import sys
from pathlib import Path

import pytest

import radiance.kernels.triton_support as triton_support
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import early_release_ab as ab  # noqa: E402


def test_parse_variant():
    assert ab.parse_variant("none") == frozenset()
    assert ab.parse_variant("parts_quantize,norm") == frozenset({"norm", "parts_quantize"})
    assert ab.label(ab.parse_variant("parts_quantize,norm")) == "norm,parts_quantize"
    with pytest.raises(ValueError, match="rotary"):
        ab.parse_variant("norm,rotary")


def test_dry_run_on_the_cpu():
    lines = []
    variants = [frozenset(), frozenset({"norm"})]
    before = triton_support.PDL_EARLY_RELEASE
    rows = ab.run("synthetic:llama-3.1-8b", variants, batches=[1, 2], repeats=1, device="cpu",
                  overrides={**TINY, "vocab_size": 512}, steps=2, log=lines.append)
    assert [names for names, _ in rows] == variants
    assert all(len(t) == 2 and all(math.isfinite(ms) and ms > 0 for ms in t) for _, t in rows)
    assert lines[1].startswith("norm: batch 1 ")
    assert triton_support.PDL_EARLY_RELEASE == before  # restored
