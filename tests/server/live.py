"""Start `radiance serve` as a real process and stop it (shared by the live-server and e2e tests)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tests.server.fake_engine import free_port

LOAD_TIMEOUT_S = 300  # the embedded model loads in ~20 s; a busy 2-core CI box can be much slower


def radiance_command() -> list[str]:
    """The installed `radiance` entry point when there is one, else the same CLI through python -m."""
    exe = shutil.which("radiance")
    return [exe] if exe else [sys.executable, "-m", "radiance.cli"]


@contextlib.contextmanager
def running_server(serve_args: list[str], port: int | None = None):
    """Yields (base_url, process, log_path, health_codes): the log holds everything the server printed,
    health_codes the /health statuses seen while waiting for it (503 while the model loads)."""
    port = port or free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="radiance-serve-", suffix=".log", delete=False)
    cmd = radiance_command() + serve_args + ["--port", str(port)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    health_codes: list[int] = []
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log.name).read()[-3000:]}")
            try:
                health_codes.append(httpx.get(url + "/health", timeout=2).status_code)
                if health_codes[-1] == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {LOAD_TIMEOUT_S} s:\n{open(log.name).read()[-3000:]}")
            time.sleep(0.25)
        yield url, proc, log.name, health_codes
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
