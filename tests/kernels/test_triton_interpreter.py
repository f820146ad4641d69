"""Runs the Triton kernel cases (triton_cases_*.py) in a subprocess: on the CPU through the Triton interpreter
(TRITON_INTERPRET is read when Triton is first imported, and this process may already have imported it without),
and compiled on a GPU machine (`-m gpu`; pytest collects only test_*.py, so nothing else runs them there)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASES = sorted(str(p) for p in HERE.glob("triton_cases_*.py"))
# two subprocesses, each within its own time limit: the GEMM's cases take about half of the interpreter's ten minutes
GEMM = [c for c in CASES if Path(c).name == "triton_cases_gemm.py"]
GROUPS = {"gemm": GEMM, "others": [c for c in CASES if c not in GEMM]}


def _run_cases(cases: list[str], env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *cases],
                          cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_the_groups_hold_every_case_file():
    assert GEMM and sorted(GROUPS["gemm"] + GROUPS["others"]) == CASES


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the cases compiled (the test below)")
@pytest.mark.parametrize("group", GROUPS)
def test_triton_kernels_under_interpreter(group):
    _run_cases(GROUPS[group], dict(os.environ, TRITON_INTERPRET="1"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_compiled_on_the_gpu():
    _run_cases(CASES, {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
