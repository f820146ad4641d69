"""tools/grid_barrier_bench.py: its CPU dry run (the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when
Triton is imported) checks that the chain of launches and the persistent kernel both sum what torch sums."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "tools" / "grid_barrier_bench.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_sums_as_torch_does():
    proc = _run("--mb", "0", "0.05", "--phases", "5", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("both kernels sum as torch does") == 2, proc.stdout


def test_dry_run_needs_the_interpreter():
    proc = _run("--dry-run", interpret=False)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
