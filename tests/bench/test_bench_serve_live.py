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


def test_a_vllm_bench_serve_line_against_radiance_server(radiance_server, tmp_path, capsys):
    """vLLM's command line as it is: its prompts fitted to exactly --random-input-len tokens with /tokenize (the
    server's usage then reports them), and the saved result file carries vLLM's keys for the percentiles chosen."""
    rc = main(["bench", "serve", "--backend", "openai", "--base-url", radiance_server, "--endpoint", "/v1/completions",
               "--dataset-name", "random", "--random-input-len", "12", "--random-output-len", "4",
               "--num-prompts", "2", "--max-concurrency", "2", "--request-rate", "inf", "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm"])
    assert rc == 0
    assert "Median TPOT (ms):" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["completed"], saved["failed"], saved["total_output_tokens"]) == (2, 0, 2 * 4)
    assert saved["total_input_tokens"] == 2 * 12  # exactly, not 12 words
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert all(saved[f"{k}_{name}_ms"] > 0 for k in ("mean", "median", "p50", "p90", "p99")), name
    assert saved["total_token_throughput"] > saved["output_throughput"] > 0
