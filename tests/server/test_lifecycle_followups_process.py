"""`radiance serve` processes stopped by a signal: Ctrl+C while the model loads, SIGTERM while a stream runs.
The engine is scripted (no weights to read): a load that never ends, or the real AsyncLLMEngine stepping a
StepEngine, so each process is up within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tests.server.fake_engine import free_port
from tests.server.test_lifecycle_followups import data_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# `radiance serve` in a process whose engine is scripted: argv[1] says how
SERVE = """
import sys, time
import radiance.engine
from radiance.engine.async_engine import AsyncLLMEngine
from tests.server.test_lifecycle_followups import StepEngine

def never_loads(config, checkpoint=None, **_):
    time.sleep(120)

def steps(config, checkpoint=None, **_):
    return AsyncLLMEngine(engine=StepEngine(step_s=0.05))

radiance.engine.AsyncLLMEngine = never_loads if sys.argv[1] == "never-loads" else steps
from radiance.cli import main
sys.exit(main(["serve", "--port", sys.argv[2], "--uvicorn-log-level", "info"]))
"""


def start(how: str, health: int):
    """(process, base url, log file) of a server whose /health answers `health` (503 while loading)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="radiance-serve-", suffix=".log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", SERVE, how, str(port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, open(log.name).read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == health:
                return proc, url, log
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, open(log.name).read()
        time.sleep(0.1)


def stopped_within(proc: subprocess.Popen, sig: int, seconds: float) -> float:
    started = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {seconds} s after the signal") from None
    return time.monotonic() - started


def test_ctrl_c_while_the_model_loads_exits_at_once_with_one_line():
    """Ctrl+C while the weights loaded waited for the load to end (minutes for a large model) before exiting."""
    proc, url, log = start("never-loads", health=503)
    with log:
        stopped_within(proc, signal.SIGINT, 10)
        text = open(log.name).read()
    assert proc.returncode == 130, text
    assert text.rstrip().splitlines()[-1] == "radiance serve: interrupted while the model was loading", text
    assert "Traceback" not in text


def test_sigterm_during_a_stream_ends_it_stops_the_engine_and_exits():
    """The stream in flight ends with its error event and [DONE] once uvicorn's graceful wait (5 s) is over; the
    engine's loop and thread stop (they were left to the interpreter's exit); uvicorn's access line carries the
    client's X-Request-Id."""
    proc, url, log = start("steps", health=200)
    with log:
        body = {"prompt": "x", "max_tokens": 400, "stream": True}  # 20 s of steps
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                          headers={"X-Request-Id": "sigterm-stream"}) as r:
            lines = r.iter_lines()
            next(lines)
            elapsed = stopped_within(proc, signal.SIGTERM, 15)
            events = data_lines("\n".join(lines))
        text = open(log.name).read()
    assert r.headers["x-request-id"] == "sigterm-stream"
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert proc.returncode == -signal.SIGTERM and elapsed < 10, (proc.returncode, elapsed)
    assert "engine stopped" in text and "Traceback" not in text, text
    assert '[sigterm-stream] 127.0.0.1' in text and '"POST /v1/completions HTTP/1.1" 200' in text, text


def test_a_second_ctrl_c_during_the_graceful_wait_quits_with_one_line():
    """uvicorn's "CTRL+C to force quit": the re-raised signal met the lifespan task, and two tracebacks
    (KeyboardInterrupt, then a CancelledError in Starlette's lifespan) were logged."""
    proc, url, log = start("steps", health=200)
    with log:
        body = {"prompt": "x", "max_tokens": 400, "stream": True}  # 20 s of steps
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept: a collected iterator closes the stream
            next(lines)
            proc.send_signal(signal.SIGINT)  # the graceful wait begins: the stream runs on
            time.sleep(0.5)
            stopped_within(proc, signal.SIGINT, 10)
        text = open(log.name).read()
    assert proc.returncode == 130, text
    assert text.rstrip().splitlines()[-1] == ("radiance serve: forced to quit (Ctrl+C twice); requests still "
                                              "running were cut"), text
    assert "Traceback" not in text, text
