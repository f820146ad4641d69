"""tools/gated_delta_prefill_sweep.py: the chunked forms' spec,
BLOCK_V[:OUTPUT_BLOCK_V]/PRECISION[:OUTPUT_PRECISION]/WARPS[:SCAN_WARPS[:OUTPUT_WARPS]]/INVERSE[/SCAN_STAGES]."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gated_delta_prefill_sweep as sweep  # noqa: E402


def test_a_chunked_form_parses_with_and_without_the_output_and_scan_launches_own_settings():
    assert sweep.parse_chunked("32/tf32x3/4/doubling") == dict(
        block_v=32, output_block_v=32, precision="tf32x3", output_precision=None, num_warps=4, scan_warps=4,
        output_warps=4, inverse="doubling", scan_stages=None)
    assert sweep.parse_chunked("16:128/ieee:tf32/4:8:2/blocks/2") == dict(
        block_v=16, output_block_v=128, precision="ieee", output_precision="tf32", num_warps=4, scan_warps=8,
        output_warps=2, inverse="blocks", scan_stages=2)
    assert sweep.parse_chunked("32:64/tf32x3/4:8/blocks")["output_warps"] == 4  # the output launch's: WARPS
    assert sweep.chunked_label(sweep.parse_chunked("32:64/tf32x3:tf32/4:8/blocks")) == \
        "chunked 32:64/tf32x3:tf32/4:8:4/blocks"
    assert sweep.chunked_label(sweep.parse_chunked("32:64/tf32x3/4:8/blocks")) == "chunked 32:64/tf32x3/4:8:4/blocks"
    assert sweep.chunked_label(sweep.parse_chunked("32:64/tf32x3/4:8/blocks/1")) == \
        "chunked 32:64/tf32x3/4:8:4/blocks/1"
    for bad in ("32/tf32x3/4", "x/ieee/4/rows", "16:y/ieee/4/rows", "16/ieee/4:z/rows", "16/ieee/4:8:w/rows",
                "16/ieee/4/rows/x", "16/ieee/4/rows/2/3"):
        with pytest.raises(ValueError):
            sweep.parse_chunked(bad)
