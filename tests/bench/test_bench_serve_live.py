"""`radiance bench serve` against our own server on the embedded model (two tiny levels)."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radiance.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def radiance_server():
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "radiance.cli", "serve", "--port", str(port), "--device", "cpu",
                             "--max-model-len", "256", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail("radiance serve exited early:\n" + proc.stdout.read().decode(errors="replace")[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("radiance serve did not become healthy in 240 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_serve_against_radiance_server(radiance_server, capsys):
    rc = main(["bench", "serve", "--url", radiance_server, "--concurrency", "1,2", "--num-prompts", "2",
               "--input-len", "16", "--output-len", "8", "--warmup", "1", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    for lv in result["levels"]:
        assert (lv["ok"], lv["failed"]) == (2, 0), lv["errors"]
        assert lv["output_tokens"] == 2 * 8  # ignore_eos: exactly max_tokens each
        assert lv["mean_prompt_tokens"] >= 16  # reported by the server's usage
        assert lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["p50"] > 0
        assert lv["aggregate_tok_s"] > 0
    rc = main(["bench", "serve", "--url", radiance_server, "--concurrency", "1", "--num-prompts", "1",
               "--input-len", "8", "--output-len", "4", "--endpoint", "chat", "--warmup", "0", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["levels"][0]["ok"] == 1
