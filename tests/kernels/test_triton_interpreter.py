"""Runs the Triton kernel cases (triton_cases_*.py) on the CPU through the Triton interpreter, in a
subprocess: TRITON_INTERPRET is read when Triton is first imported, and this process may already
have imported it without. On a GPU machine test_gpu.py runs the same cases compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASES = sorted(str(p) for p in HERE.glob("triton_cases_*.py"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the cases compiled (test_gpu.py)")
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES],
                          cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
