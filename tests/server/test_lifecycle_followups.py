"""Follow-ups on the server's life cycle: X-Request-Id on every answer (and on the log lines of its request),
the engine stopped with the server, a stop while the model loads, in-band stream errors in /metrics.

`StepEngine` is a synchronous engine the real AsyncLLMEngine drives (its loop, its stepping thread), one token
per step; test_lifecycle_followups_process.py serves it from a `radiance serve` process."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.engine.async_engine import AsyncLLMEngine, EngineStoppedError
from radiance.engine.outputs import EngineStats, StepOutput
from radiance.engine.sampling_params import SamplingParams
from radiance.server.api import build_app
from radiance.server.cli import RequestIdLogFilter
from radiance.server.state import ServerState
from tests.server.fake_engine import TEMPLATE, ByteTokenizer, FakeEngine, serve_engine, serve_in_thread
from tests.server.test_async_lifecycle import uvicorn_server

CHAT = "/v1/chat/completions"


class StepEngine:
    """The synchronous engine's surface AsyncLLMEngine uses: every step takes `step_s` and adds the token "a" to
    each request, up to its max_tokens."""

    def __init__(self, step_s: float = 0.02):
        self.step_s = step_s
        self.tokenizer = ByteTokenizer()
        self.tokenizer_error = None
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = 512
        self.chat_template = TEMPLATE
        self.chat_templates: dict = {}
        self.model_name = "step-model"
        self.load_summary = ["model: step-model (scripted)"]
        self.running: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def warm_grammar_backend(self):
        return None

    def check_one_sequence(self, params):
        pass

    def check_request(self, prompt_token_ids, params):
        pass

    def add_request(self, request_id, prompt_token_ids, params=None):
        self.running[request_id] = (list(prompt_token_ids), params or SamplingParams(), [])

    def abort_request(self, request_id):
        self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def stats(self):
        return EngineStats(len(self.running), 0, 0.0, 0, 0, 0)

    def step(self):
        time.sleep(self.step_s)
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.running.items()):
            tokens.append(ord("a"))
            done = len(tokens) >= params.max_tokens
            outputs.append(StepOutput(request_id, prompt, "a" * len(tokens), list(tokens), None,
                                         "length" if done else None, done))
            if done:
                del self.running[request_id]
        return outputs


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("radiance-engine")]


def wait_for(condition, timeout: float = 10, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def data_lines(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def error_count(metrics_text: str, status: str) -> float:
    found = re.search(rf'radiance_request_errors_total{{model_name="[^"]*",status="{status}"}} (\S+)', metrics_text)
    return float(found.group(1)) if found else 0.0


# ------------------------------------------------------------------ X-Request-Id

@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine()
    with serve_engine(engine, api_key="sk-x") as url:
        yield url, engine


def _answers(url: str, headers: dict) -> dict[str, httpx.Response]:
    auth = {"Authorization": "Bearer sk-x", **headers}
    chat = {"messages": [{"role": "user", "content": "SAY:hi"}]}
    with httpx.Client(base_url=url, timeout=30) as client:
        answers = {
            "health": client.get("/health", headers=headers),
            "models": client.get("/v1/models", headers=auth),
            "chat": client.post(CHAT, json=chat, headers=auth),
            "unknown model": client.post(CHAT, json={**chat, "model": "nope"}, headers=auth),
            "bad request": client.post(CHAT, json={"messages": "x"}, headers=auth),
            "no key": client.get("/v1/models", headers=headers),
            "no route": client.get("/nowhere", headers=auth),
        }
        with client.stream("POST", CHAT, json={**chat, "stream": True}, headers=auth) as r:
            r.read()
            answers["chat stream"] = r
        with client.stream("POST", "/v1/completions", json={"prompt": "SAY:hi", "stream": True}, headers=auth) as r:
            r.read()
            answers["completion stream"] = r
    return answers


def test_every_answer_returns_the_clients_x_request_id(fake_server):
    """vLLM answers with the client's X-Request-Id (errors and streams too); the server sent none."""
    answers = _answers(fake_server[0], {"X-Request-Id": "trace-42"})
    assert [a.status_code for a in answers.values()] == [200, 200, 200, 404, 400, 401, 404, 200, 200]
    for name, answer in answers.items():
        assert answer.headers.get_list("x-request-id") == ["trace-42"], name
    assert answers["chat"].json()["id"].startswith("chatcmpl-")  # the body's id stays OpenAI's


def test_an_answer_without_a_client_id_gets_a_new_one_each(fake_server):
    answers = _answers(fake_server[0], {})
    ids = [answer.headers.get("x-request-id") for answer in answers.values()]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i or "") for i in ids), ids
    assert len(set(ids)) == len(ids)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.addFilter(RequestIdLogFilter())
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def test_log_lines_of_a_request_carry_its_id(fake_server):
    """The line a failed request logs names the X-Request-Id its client sent (also when it holds a %, the
    line's own arguments formatted after it), and a line logged outside any request is left alone."""
    url, _engine = fake_server
    handler = _Lines()
    logging.getLogger().addHandler(handler)
    try:
        body = {"messages": [{"role": "user", "content": "SAY:abcFAILxyz"}]}
        r = httpx.post(url + CHAT, json=body, headers={"Authorization": "Bearer sk-x", "X-Request-Id": "50%-trace"})
        logging.getLogger("radiance.test").warning("outside %s", "any request")
    finally:
        logging.getLogger().removeHandler(handler)
    assert r.status_code == 500 and r.headers["x-request-id"] == "50%-trace"
    failed = [line for line in handler.lines if "internal error while serving" in line]
    assert failed and failed[0].startswith("radiance.server.api: [50%-trace] internal error while serving "
                                           "/v1/chat/completions"), handler.lines
    assert "radiance.test: outside any request" in handler.lines


# ------------------------------------------------------------------ metrics

def test_a_stream_that_fails_midway_counts_as_an_error():
    """A stream that ended with an error event after its 200 was counted nowhere in request_errors."""
    with serve_engine(FakeEngine()) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "SAY:abcFAILxyz", "stream": True})
        assert json.loads(data_lines(r.text)[-2])["error"]["type"] == "internal_server_error"
        metrics = httpx.get(url + "/metrics").text
    assert error_count(metrics, "500") == 1.0


def test_a_stream_whose_client_left_is_no_server_error():
    """The stream of a client that went away ends with the shutdown's 503 event that nobody reads: counted as a
    client that left (499, as a non-streaming one is answered), not as a 503 of the server's."""
    engine = FakeEngine()
    with serve_engine(engine) as url:
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "SAY:SLOW" + "z" * 100, "stream": True},
                          timeout=30) as r:
            next(r.iter_lines())
        wait_for(lambda: engine.aborted, what="the request was not aborted")
        metrics = httpx.get(url + "/metrics").text
    assert error_count(metrics, "503") == 0.0
    assert error_count(metrics, "499") == 1.0


def test_a_responses_stream_whose_client_left_is_stored_cancelled():
    """A Responses stream cut by its client was stored failed with "the server is shutting down" (the in-band event
    nobody reads); a later GET finds it cancelled, no error set."""
    engine = FakeEngine()
    with serve_engine(engine) as url:
        with httpx.stream("POST", url + "/v1/responses", json={"input": "SAY:SLOW" + "z" * 100, "stream": True},
                          timeout=30) as r:
            created = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        wait_for(lambda: engine.aborted, what="the request was not aborted")
        response_id = created["response"]["id"]
        wait_for(lambda: httpx.get(f"{url}/v1/responses/{response_id}").json()["status"] != "in_progress",
                 what="the response stayed in_progress")
        stored = httpx.get(f"{url}/v1/responses/{response_id}").json()
    assert stored["status"] == "cancelled" and stored["error"] is None, stored


# ------------------------------------------------------------------ engine shutdown

def test_engine_shutdown_ends_waiting_calls_and_joins_its_threads():
    """AsyncLLMEngine had no way to stop: its loop and threads outlived the server, and a generate call
    waiting on a loop that was stopped waited forever."""
    engine = AsyncLLMEngine(engine=StepEngine(step_s=0.05))
    params = SamplingParams(max_tokens=1000)

    async def run():
        stream = engine.generate("r", [1, 2, 3], params)
        await anext(stream)
        waiting = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)
        await asyncio.wait_for(engine.shutdown(), 5)
        with pytest.raises(EngineStoppedError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(EngineStoppedError):
            await anext(engine.generate("later", [1], params))
        engine.abort("r")  # what a request's cleanup does after the stop: nothing to do, no error
        await engine.shutdown()  # twice is harmless

    asyncio.run(run())
    assert engine.stopped and not engine_threads()


def test_the_server_stopping_stops_the_engine_and_ends_its_streams():
    """A stream in flight when the server stops ends with its error event and [DONE]; then the engine's loop
    stops and its stepping thread is joined (it stayed, idle, after the server was gone)."""
    engine = AsyncLLMEngine(engine=StepEngine(step_s=0.05))
    result = {}

    def stream(url):
        body = {"prompt": "x", "max_tokens": 400, "stream": True}
        result["response"] = httpx.post(url + "/v1/completions", json=body, timeout=30)

    with uvicorn_server(engine, graceful_s=0.3) as (url, server, _logged):
        client = threading.Thread(target=stream, args=(url,))
        client.start()
        wait_for(lambda: engine.engine.running, what="the request did not start")
        server.should_exit = True
        client.join(timeout=15)
    events = data_lines(result["response"].text)
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert engine.stopped and not engine_threads()


# ------------------------------------------------------------------ stopping while the model loads

def test_stopping_while_the_model_loads_does_not_wait_for_the_load():
    """The load ran in asyncio's default executor, which asyncio.run joins at its end: a stop during a load of
    minutes (Ctrl+C) waited for the load to finish."""
    gate = threading.Event()

    def slow_factory():
        gate.wait(15)
        return FakeEngine()

    state = ServerState(ServerConfig(), engine_factory=slow_factory)
    app = build_app(state)

    async def start_and_stop():
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.2)

    started = time.monotonic()
    try:
        asyncio.run(start_and_stop())
        elapsed = time.monotonic() - started
        assert state.loading and not state.ready
    finally:
        gate.set()
    assert elapsed < 3, f"the stop waited {elapsed:.1f} s for the load"
    wait_for(lambda: not state.loading, what="the load thread did not end")
    assert state.load_error is None and not state.ready  # a load that ends after the stop is dropped


def test_a_load_in_its_thread_still_serves_once_done():
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=FakeEngine)
    with serve_in_thread(build_app(state)) as url:
        wait_for(lambda: state.ready, what="the model did not load")
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "SAY:ok"}]})
    assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_load_that_fails_by_a_bug_is_reported_once(monkeypatch, caplog):
    """An unexpected load error (not a config mistake) was logged with its traceback as it happened, then raised
    again out of `radiance serve`, which printed the same traceback a second time."""
    import radiance.engine
    from radiance.cli import main

    def broken_engine(config, checkpoint=None, **_):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", broken_engine)
    assert main(["serve", "--port", "0"]) == 1
    failed = [r for r in caplog.records if r.getMessage() == "model failed to load"]
    assert len(failed) == 1 and "disk on fire" in str(failed[0].exc_info[1])
    assert not [f for h in logging.getLogger().handlers for f in h.filters if isinstance(f, RequestIdLogFilter)]
