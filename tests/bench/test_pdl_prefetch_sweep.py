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


def test_one_shape_swept_leaves_the_others_and_is_restored():
    saved_tiles, saved_shapes = w4a8_module.PDL_PREFETCH_TILES, dict(w4a8_module.PDL_PREFETCH_TILES_BY_SHAPE)
    seen = []
    real_alternate = pdl_prefetch_sweep.decode_ablation.alternate

    def spy(engine, module, name, values, *args):
        seen.append((name, values))
        return real_alternate(engine, module, name, values, *args)

    pdl_prefetch_sweep.decode_ablation.alternate = spy
    try:
        rows = pdl_prefetch_sweep.run("synthetic:llama-3.1-8b", tiles=(4, 1), batches=(1,), repeats=1, device="cpu",
                                      overrides={**TINY, "vocab_size": 512}, steps=2, shape=(64, 128),
                                      log=lambda line: None)
    finally:
        pdl_prefetch_sweep.decode_ablation.alternate = real_alternate
    assert [t for t, _ in rows] == [4, 1]
    assert seen == [("PDL_PREFETCH_TILES_BY_SHAPE", [{**saved_shapes, (64, 128): 4}, {**saved_shapes, (64, 128): 1}])]
    assert w4a8_module.PDL_PREFETCH_TILES == saved_tiles
    assert w4a8_module.PDL_PREFETCH_TILES_BY_SHAPE == saved_shapes


def test_a_shape_override_applies_to_that_shape_only(monkeypatch):
    monkeypatch.setattr(w4a8_module, "PDL_PREFETCH_TILES_BY_SHAPE", {(4096, 14336): 3})
    assert w4a8_module.pdl_prefetch_tiles(4096, 14336) == 3
    assert w4a8_module.pdl_prefetch_tiles(14336, 4096) == w4a8_module.PDL_PREFETCH_TILES


def test_shape_text_is_parsed_or_refused():
    assert pdl_prefetch_sweep.parse_shape("4096x14336") == (4096, 14336)
    with pytest.raises(ValueError, match="NxK"):
        pdl_prefetch_sweep.parse_shape("4096-14336")


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="K tile counts"):
        pdl_prefetch_sweep.run("synthetic:llama-3.1-8b", tiles=(1, -1), device="cpu")
