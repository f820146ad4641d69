"""Runs a tools/ script in a subprocess, under the Triton interpreter unless told otherwise: TRITON_INTERPRET is read
when Triton is first imported, so a test process that has imported it cannot switch."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tool(script: str, *args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "tools" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
