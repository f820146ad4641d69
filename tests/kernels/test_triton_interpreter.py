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


def _run_cases(env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES],
                          cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the cases compiled (the test below)")
def test_triton_kernels_under_interpreter():
    _run_cases(dict(os.environ, TRITON_INTERPRET="1"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_compiled_on_the_gpu():
    _run_cases({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
