"""tools/delta_rule_resources.py: the chunked delta rule's served launches compiled for sm_90 on this machine (no GPU):
each fits one SM's shared memory at Qwen3.5-9B's heads, and the report reads the compiler's numbers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import delta_rule_resources as resources  # noqa: E402


def test_the_served_launches_fit_an_sm90_sm_and_report_their_registers():
    served = [launch for launch in resources.launches(128, 128, inverses=("blocks",))]
    assert [name for name, *_ in served] == ["prepare (blocks)", "scan", "output"]
    for name, fn, signature, constants, warps, stages in served:
        used = resources.compile_for_sm90(fn, signature, constants, warps, stages)
        assert 0 < used.registers <= 255, name
        assert 0 < used.shared <= resources.SHARED_PER_SM, name  # a launch that does not fit fails on the GPU
        assert used.wgmma > 0, name  # its products on the tensor cores
        assert (used.stack == 0) == (used.spill_instructions == 0), name


def test_the_report_prints_a_row_per_launch(capsys):
    assert resources.main(["--dk", "32", "--dv", "32", "--launches", "output"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Triton ") and "Dk 32, Dv 32" in lines[0]
    assert len(lines) == 4 and lines[3].startswith("| output | ")
