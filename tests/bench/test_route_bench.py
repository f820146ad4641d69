"""tools/route_bench.py: its CPU dry run (the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when Triton
is imported) checks that every setting of the routing switches routes alike."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "tools" / "route_bench.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_finds_every_variant_alike():
    proc = _run("--tokens", "1", "3", "8", "--models", "128x8", "32x4", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("every variant routes alike") == 6, proc.stdout


def test_dry_run_needs_the_interpreter():
    proc = _run("--dry-run", interpret=False)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
