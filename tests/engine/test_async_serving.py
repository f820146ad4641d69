"""The server's request lifecycle on real engines (the embedded SmolLM2 and a tiny random model, on the CPU):
a client that hangs up before its first token or while queued frees its engine request at once, concurrent
clients leave no request behind and the metrics add up, and an engine step that raises ends every request
with a 500 (or a stream's error event) and turns /health unhealthy."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine, EngineDeadError
from tests.server.fake_engine import serve_engine


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A POST on a plain socket, to hang up whenever the test wants."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def idle(engine) -> bool:
    stats = engine.stats()
    return (not engine.has_unfinished_requests() and stats.num_running == 0 and stats.num_waiting == 0
            and stats.kv_cache_usage == 0)


class GatedSteps:
    """Holds the engine's next step (in its thread) until `release`: requests added meanwhile sit in the
    scheduler, not yet computed."""

    def __init__(self, engine, monkeypatch):
        self._step = engine.step
        self.opened = threading.Event()
        self.held = threading.Event()
        monkeypatch.setattr(engine, "step", self.step)

    def step(self):
        if not self.opened.is_set():
            self.held.set()
            self.opened.wait(20)
        return self._step()

    def release(self):
        self.opened.set()


STORY = "Tell me a long story."
HANG_UPS = [  # each would run on for 50 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": STORY}], "max_tokens": 50, "stream": True}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}),
    ("/v1/responses", {"input": STORY, "max_output_tokens": 50, "stream": True}),
    ("/v1/responses", {"input": STORY, "max_output_tokens": 50}),
]


@pytest.mark.parametrize("path,body", HANG_UPS, ids=["chat-stream", "completions", "responses-stream", "responses"])
def test_a_client_gone_before_its_first_token_is_aborted(smollm2, monkeypatch, path, body):
    engine = smollm2.engine
    async_engine = AsyncLLMEngine(engine=engine)
    with serve_engine(async_engine) as url:
        gate = GatedSteps(engine, monkeypatch)
        sock = raw_post(url, path, body)
        assert gate.held.wait(20)
        assert engine.stats().num_waiting == 1  # added, not yet scheduled: its prefill is the held step
        generated = engine.generation_tokens_total
        sock.close()
        assert wait_for(lambda: not async_engine._queues)  # the server saw the hang-up and queued the abort
        gate.release()
        assert wait_for(lambda: idle(engine)), engine.stats()
        assert engine.generation_tokens_total - generated <= 1  # the step under way, then nothing
        assert not async_engine._serving


def test_a_client_gone_while_queued_leaves_the_queue(tiny_text_llm):
    """max_num_seqs=1: the second request waits in the scheduler until its client hangs up."""
    engine = tiny_text_llm(max_num_seqs=1).engine
    async_engine = AsyncLLMEngine(engine=engine)
    long = {"max_tokens": 400, "ignore_eos": True}
    with serve_engine(async_engine) as url:
        running = raw_post(url, "/v1/completions", {"prompt": "The quick brown fox", "stream": True, **long})
        assert wait_for(lambda: engine.stats().num_running == 1)
        queued = raw_post(url, "/v1/completions", {"prompt": "Paris is the capital", **long})
        assert wait_for(lambda: engine.stats().num_waiting == 1)
        queued.close()
        assert wait_for(lambda: engine.stats().num_waiting == 0)
        assert engine.stats().num_running == 1  # the other request runs on
        running.close()
        assert wait_for(lambda: idle(engine)), engine.stats()
        assert not async_engine._queues and not async_engine._serving


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics (parsed by prometheus_client's own parser), labels but model_name in the key."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            samples[sample.name + (json.dumps(labels, sort_keys=True) if labels else "")] = sample.value
    return samples


def test_concurrent_clients_some_gone_leave_nothing_behind(smollm2):
    engine = smollm2.engine
    async_engine = AsyncLLMEngine(engine=engine)

    async def finish(client, k):
        stream = k % 2 == 0
        body = {"prompt": f"Number {k} is", "max_tokens": 3 + k % 3, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = await client.post("/v1/completions", json=body)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        return json.loads(events[-2])["usage"] if stream else r.json()["usage"]

    async def hang_up(client, k):
        # ignore_eos: a sampled answer may end by EOS within the timeout (62 tokens in 2 s seen here), and the request
        # then completes instead of being left
        body = {"messages": [{"role": "user", "content": f"Story {k}"}], "max_tokens": 200, "stream": k % 2 == 0,
                "ignore_eos": True}
        with pytest.raises(asyncio.TimeoutError):
            # long enough to reach the engine on a loaded 2-core CI machine (0.3 s once left before it: an abort
            # never counted), short of the 200 tokens' ~5 s
            await asyncio.wait_for(client.post("/v1/chat/completions", json=body), timeout=1.0 + 0.25 * k)

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            usages = await asyncio.gather(*[finish(client, k) for k in range(4)],
                                          *[hang_up(client, k) for k in range(4)])
        return usages[:4]

    with serve_engine(async_engine) as url:
        before = scrape(url)
        usages = asyncio.run(run(url))
        assert wait_for(lambda: idle(engine)), engine.stats()
        after = scrape(url)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert after["radiance_num_requests_running"] == after["radiance_num_requests_waiting"] == 0
    assert after["radiance_kv_cache_usage_perc"] == 0
    assert grew['radiance_request_success_total{"finished_reason": "length"}'] == 4  # the finished ones
    assert grew['radiance_request_success_total{"finished_reason": "abort"}'] == 4  # the ones whose client left
    assert grew["radiance_generation_tokens_total"] >= sum(u["completion_tokens"] for u in usages)
    assert grew["radiance_prompt_tokens_total"] >= sum(u["prompt_tokens"] for u in usages)
    assert grew["radiance_e2e_request_latency_seconds_count"] == 8  # every engine request ends once
    assert not async_engine._queues and not async_engine._serving


# ------------------------------------------------------------------ an engine step that raises

def failing_steps(engine, monkeypatch, after: int = 0):
    """The engine's steps raise ValueError (not a client's error: it happens inside the engine) after `after`."""
    step, count = engine.step, [0]

    def step_or_fail():
        count[0] += 1
        if count[0] > after:
            raise ValueError("boom in step")
        return step()

    monkeypatch.setattr(engine, "step", step_or_fail)


def test_a_failed_step_fails_every_request_once_and_frees_the_engine(tiny_text_llm, monkeypatch):
    """Every waiting request got the same exception object, whose traceback grew with each task that raised it;
    the engine kept the failed step's requests (running / waiting gauges stuck above 0)."""
    engine = tiny_text_llm(max_num_seqs=4).engine
    async_engine = AsyncLLMEngine(engine=engine)
    failing_steps(engine, monkeypatch)
    params = SamplingParams(max_tokens=5, temperature=0.0)

    async def one(request_id):
        try:
            async for _ in async_engine.generate(request_id, [5, 9, 200, 17], params):
                pass
        except EngineDeadError as exc:
            return exc

    async def run():
        errors = await asyncio.gather(one("a"), one("b"))
        with pytest.raises(EngineDeadError):
            await one_more()
        return errors

    async def one_more():
        async for _ in async_engine.generate("c", [5, 9], params):
            pass

    first, second = asyncio.run(run())
    assert isinstance(first, EngineDeadError) and isinstance(second, EngineDeadError) and first is not second
    assert isinstance(first.__cause__, ValueError) and "ValueError" in str(first)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0


def test_a_failed_step_answers_500_and_health_turns_unhealthy(tiny_text_llm, monkeypatch):
    """A ValueError out of the step reached the client as a 400 invalid_request_error carrying the internal
    message, as if the request had been refused."""
    engine = tiny_text_llm(max_num_seqs=4).engine
    async_engine = AsyncLLMEngine(engine=engine)
    failing_steps(engine, monkeypatch)

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"prompt": "The quick brown fox", "max_tokens": 5}
            return await asyncio.gather(client.post("/v1/completions", json=body),
                                        client.post("/v1/completions", json={**body, "stream": True}))

    with serve_engine(async_engine) as url:
        plain, stream = asyncio.run(run(url))
        health = httpx.get(url + "/health")
        later = httpx.post(url + "/v1/completions", json={"prompt": "The quick", "max_tokens": 2})
    assert plain.status_code == 500, plain.text
    error = plain.json()["error"]
    assert error["type"] == "internal_server_error" and "boom" not in error["message"]
    assert "engine stopped" in error["message"]
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "internal_server_error"
    assert health.status_code == 503 and later.status_code == 503
