"""tools/gated_delta_prefill_sweep.py: the chunked forms' spec,
BLOCK_V[:OUTPUT_BLOCK_V]/PRECISION/WARPS[:SCAN_WARPS]/INVERSE."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gated_delta_prefill_sweep as sweep  # noqa: E402


def test_a_chunked_form_parses_with_and_without_its_own_output_block_and_scan_warps():
    assert sweep.parse_chunked("32/tf32x3/4/doubling") == (32, 32, "tf32x3", 4, 4, "doubling")
    assert sweep.parse_chunked("16:128/ieee/4:8/blocks") == (16, 128, "ieee", 4, 8, "blocks")
    for bad in ("32/tf32x3/4", "x/ieee/4/rows", "16:y/ieee/4/rows", "16/ieee/4:z/rows"):
        with pytest.raises(ValueError):
            sweep.parse_chunked(bad)
