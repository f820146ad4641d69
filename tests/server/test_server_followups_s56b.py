"""Server follow-ups of the fifty-sixth session, second part (scripts under scratch/s56/metrics/).

1. vLLM's prefix-cache counters of prompt tokens, under both name prefixes: prompt_tokens_cached (the prompt tokens
   found in the prefix cache) and prompt_tokens_by_source (source local_compute / local_cache_hit /
   external_kv_transfer, the last always 0: radiance loads no KV from elsewhere), counted per engine request once its
   prefill is done (its first output), or at its end when none came; shown at 0 from the start, as vLLM's are.
2. A streamed response's in-progress and final stored copies share the ids given its input items (each store
   listed them anew, with new ids).
3. A client that half-closes (shutdown(SHUT_WR)) after its request is a client gone, as under vLLM (same uvicorn):
   uvicorn closes the connection at the FIN, and keeping it open would let a non-streaming request whose client
   closed its socket run to its end (a FIN is all the server sees of either; scratch/s56/metrics/
   half_close_tradeoff.py).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radiance.server.metrics import RequestTimer, ServerMetrics
from tests.engine.test_metrics_vllm_parity import _samples
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.test_metrics_followups import TimedEngine, caching_tiny_llama

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


# 1. prompt_tokens_cached / prompt_tokens_by_source


@pytest.mark.parametrize("prefix", ["radiance_", "vllm:"])
def test_prompt_tokens_by_source_and_cached_count_each_engine_requests_hits(prefix):
    engine = TimedEngine()  # a quarter of every prompt (rounded down) found in the prefix cache
    bodies = [  # 1 + 2 + 2 + 1 engine requests
        ("/v1/completions", {"prompt": "SAY:hello", "max_tokens": 8}),
        ("/v1/completions", {"prompt": ["SAY:ab", "SAY:a much longer prompt"], "max_tokens": 8, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:two choices"}], "n": 2}),
        ("/v1/responses", {"input": "SAY:a response"}),
    ]
    with serve_engine(engine, metrics_prefix=prefix) as url:
        for path, body in bodies:
            assert httpx.post(url + path, json={"model": "fake", **body}, timeout=30).status_code == 200
        text = httpx.get(url + "/metrics", timeout=30).text
    samples = _samples(text)

    def value(name, **labels):
        return samples[prefix + name, tuple(sorted(labels.items()))]

    requests = list(engine.final.values())
    cached = sum(hits for _, hits, _, _ in requests)
    assert len(requests) == 6 and cached > 0
    assert value("prompt_tokens_cached_total") == cached
    assert value("prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert value("prompt_tokens_by_source_total", source="local_compute") == sum(p - h for p, h, _, _ in requests)
    assert value("prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    # the split of the same prompts: by source they add up to the prompt tokens, the computed ones are the
    # histogram of computed tokens' sum
    assert sum(value("prompt_tokens_by_source_total", source=s) for s in SOURCES) == value(
        "prompt_tokens_total") == value("request_prompt_tokens_sum")
    assert value("prompt_tokens_by_source_total", source="local_compute") == value(
        "request_prefill_kv_computed_tokens_sum")
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types[prefix + "prompt_tokens_cached"] == types[prefix + "prompt_tokens_by_source"] == "counter"


def test_every_source_shows_at_zero_before_any_request():
    with serve_engine(FakeEngine(), metrics_prefix="vllm:") as url:
        samples = _samples(httpx.get(url + "/metrics", timeout=30).text)
    assert [samples["vllm:prompt_tokens_by_source_total", (("source", s),)] for s in SOURCES] == [0, 0, 0]
    assert samples["vllm:prompt_tokens_cached_total", ()] == 0


def test_the_hits_count_once_the_first_output_comes_not_at_the_end():
    """A stream of 50 ms tokens: its hits are on /metrics after its first chunk, while it still runs (a dashboard's
    hit rate does not wait for long generations), and not counted again when it ends."""
    engine = TimedEngine()
    prompt = "SAY:SLOW and long enough"
    with serve_engine(engine) as url:
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": "fake", "prompt": prompt, "max_tokens": 32, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            during = _samples(httpx.get(url + "/metrics", timeout=30).text)
            assert "data: [DONE]" in list(lines)
        after = _samples(httpx.get(url + "/metrics", timeout=30).text)
    (tokens, hits, generated, _), = engine.final.values()
    assert hits == tokens // 4 > 0 and generated > 1
    assert during["radiance_request_prompt_tokens_count", ()] == 0  # still running
    for samples in (during, after):
        assert samples["radiance_prompt_tokens_cached_total", ()] == hits
        assert samples["radiance_prompt_tokens_by_source_total", (("source", "local_compute"),)] == tokens - hits


def test_a_request_ended_before_any_output_counts_the_engines_hits_once():
    metrics = ServerMetrics(lambda: None, lambda: "m", max_model_len=lambda: 512)
    left = RequestTimer(metrics, num_prompt_tokens=40)
    left.finished("abort", num_cached_tokens=32)  # admitted, hits known, gone before its first output
    left.finished("abort", num_cached_tokens=32)
    done = RequestTimer(metrics, num_prompt_tokens=10)
    for n in (1, 2, 3):
        done.tokens(n, num_cached_tokens=4)
    done.finished("stop")
    never = RequestTimer(metrics, num_prompt_tokens=7)
    never.finished("abort")  # never admitted: no hits, its whole prompt as to compute
    refused = RequestTimer(metrics, num_prompt_tokens=100)
    refused.discard()
    text = metrics.render().decode()
    samples = {(s.name, s.labels.get("source")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    assert samples["radiance_prompt_tokens_cached_total", None] == 32 + 4
    assert samples["radiance_prompt_tokens_by_source_total", "local_cache_hit"] == 32 + 4
    assert samples["radiance_prompt_tokens_by_source_total", "local_compute"] == 8 + 6 + 7


def test_a_real_engines_hits_are_the_cached_prompt_tokens(tmp_path):
    """The tiny random Llama 3 with prefix caching: the same prompt again finds its full blocks cached, and
    prompt_tokens_cached is the engine's own prefix_cache_hits count."""
    engine, served = caching_tiny_llama(tmp_path)
    shared = list(range(1, 41))  # two full blocks of 16, and 8 more
    prompts = [shared, shared, shared[:20] + [7] * 9]
    with serve_engine(served, metrics_prefix="vllm:") as url:
        for prompt in prompts:  # one at a time: each finds what the ones before left in the cache
            r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2,
                                                          "ignore_eos": True, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
        samples = _samples(httpx.get(url + "/metrics", timeout=30).text)
        hits = engine.stats().prefix_cache_hits_total
    assert hits == 32 + 16
    assert samples["vllm:prompt_tokens_cached_total", ()] == hits
    computed = samples["vllm:prompt_tokens_by_source_total", (("source", "local_compute"),)]
    assert computed == sum(map(len, prompts)) - hits


# 2. a streamed response's stored copies list the same input items


@pytest.fixture
def store_server():
    with serve_engine(FakeEngine()) as url:
        yield url


def test_a_streamed_responses_input_items_keep_their_ids(store_server):
    """GET input_items while the stream runs (the in-progress copy) and after (the final one): the same ids."""
    url = store_server
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/responses", json={
                "model": "fake", "stream": True,
                "input": [{"role": "user", "content": "a question"},
                          {"role": "user", "content": "SAY:SLOW ten tokens"}]}) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the stream (the client leaves)
            first = next(line for line in lines if line.startswith("data: "))
            response_id = json.loads(first[len("data: "):])["response"]["id"]
            during = client.get(f"/v1/responses/{response_id}/input_items").json()["data"]
            assert client.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress"
            assert "event: response.completed" in list(lines)
        after = client.get(f"/v1/responses/{response_id}/input_items").json()["data"]
    assert len(during) == 2 and [item["id"] for item in during] == [item["id"] for item in after]


# 3. a half-closed client


def test_a_client_that_half_closes_is_a_client_gone():
    """uvicorn closes the connection at the client's FIN (vLLM's server too): the request ends as aborted, its engine
    request does not run on. Keeping the connection open would answer a half-closed client, but a non-streaming
    request whose client closed its socket would then run to its end: should uvicorn start keeping it open
    (its issue #1264), this fails and the disconnect watcher needs another way to see a client gone."""
    engine = FakeEngine()
    with serve_engine(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        payload = json.dumps({"model": "fake", "prompt": "SAY:SLOW" + "x" * 30, "max_tokens": 64}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            s.shutdown(socket.SHUT_WR)
            answer = s.recv(65536)
        deadline = time.monotonic() + 10  # it may not even start: the FIN can come before its body is read
        while time.monotonic() < deadline and (engine.active or not engine.aborted and time.monotonic() < deadline - 8):
            time.sleep(0.01)
    assert answer == b""
    assert [request_id for request_id, _, _ in engine.requests] == engine.aborted
    assert engine.generated < 30  # aborted within the disconnect poll, not after its 38 tokens
