"""The ends of a request that are not its own: the server shutting down under it, and a bug in its route.
Each ends as an OpenAI-shaped answer (a JSON error, or a stream's error event), without uvicorn's own
"Exception in ASGI application" traceback, its text/plain 500, or a connection cut mid-way."""

import asyncio
import contextlib
import json
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, free_port
from tests.server.malformed import check_error_shape

SLOW = "SAY:SLOW" + "z" * 200  # 10 s of tokens: still running when the server stops


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def uvicorn_server(engine, graceful_s: float):
    """(url, the uvicorn.Server, what uvicorn logged) for a server in a thread in front of `engine`."""
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=graceful_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    records = Records()  # attached once uvicorn has configured its loggers (that drops other handlers)
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        yield f"http://127.0.0.1:{port}", server, records.messages
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        logging.getLogger("uvicorn.error").removeHandler(records)


def asgi_errors(messages: list[str]) -> list[str]:
    return [m for m in messages if "Exception in ASGI application" in m or "without completing" in m]


def data_lines(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_requests_in_flight_end_cleanly_when_the_server_stops():
    """uvicorn cancels what still runs after its graceful timeout: a non-streaming request got uvicorn's
    text/plain "Internal Server Error", a stream was cut without its end (the client saw an incomplete chunked
    read), and each logged a CancelledError traceback."""
    engine = FakeEngine()
    chat = {"messages": [{"role": "user", "content": SLOW}]}
    requests = {"chat": ("/v1/chat/completions", chat),
                "chat_stream": ("/v1/chat/completions", {**chat, "stream": True}),
                "completion_stream": ("/v1/completions", {"prompt": SLOW, "stream": True}),
                "responses_stream": ("/v1/responses", {"input": SLOW, "stream": True})}
    results = {}

    def send(name, url):
        path, body = requests[name]
        try:
            results[name] = httpx.post(url + path, json=body, timeout=30)
        except httpx.HTTPError as exc:
            results[name] = exc

    with uvicorn_server(engine, graceful_s=0.3) as (url, server, logged):
        clients = [threading.Thread(target=send, args=(name, url)) for name in requests]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 10
        while len(engine.active) < len(requests):
            assert time.monotonic() < deadline, engine.active
            time.sleep(0.02)
        server.should_exit = True
        for client in clients:
            client.join(timeout=20)
    check_error_shape(results["chat"], 503, None)
    assert "shutting down" in results["chat"].json()["error"]["message"]
    for name in ("chat_stream", "completion_stream"):
        events = data_lines(results[name].text)
        assert events[-1] == "[DONE]", (name, results[name].text[-300:])
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
    last = data_lines(results["responses_stream"].text)[-1]
    failed = json.loads(last)
    assert failed["type"] == "response.failed" and "shutting down" in failed["response"]["error"]["message"]
    assert not asgi_errors(logged), logged
    assert not engine.active  # each request's engine work was aborted


def test_an_internal_error_keeps_the_connection_and_logs_once(caplog):
    """A route that raised was answered by Starlette's outermost handler, which re-raises: uvicorn logged the
    traceback again ("Exception in ASGI application") and closed the keep-alive connection, so the client's
    next request on it failed (httpx.ReadError)."""
    engine = FakeEngine()
    with uvicorn_server(engine, graceful_s=1) as (url, _server, logged), httpx.Client(base_url=url) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "SAY:abcFAILxyz"}]})
        check_error_shape(r, 500, None)
        assert r.json()["error"]["message"] == "internal server error (RuntimeError)"
        assert client.get("/health").status_code == 200  # the same connection still serves
        metrics = client.get("/metrics").text
    assert 'radiance_request_errors_total{model_name="fake",status="500"} 1.0' in metrics  # counted once
    assert not asgi_errors(logged), logged
    assert len([r for r in caplog.records if "internal error while serving" in r.getMessage()]) == 1


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:abcFAILxyz"}], "stream": True}),
    ("/v1/completions", {"prompt": "SAY:abcFAILxyz", "stream": True}),
])
def test_a_stream_that_fails_ends_with_an_error_event(path, body):
    engine = FakeEngine()
    with uvicorn_server(engine, graceful_s=1) as (url, _server, logged):
        r = httpx.post(url + path, json=body)
    events = data_lines(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "internal server error (RuntimeError)"
    assert not asgi_errors(logged), logged


def test_stopping_while_the_model_loads_is_no_load_failure(caplog):
    """Ctrl+C while the weights load cancels the loading task: that was logged as "model failed to load" with a
    CancelledError traceback, kept as the load error, and reported to on_load_failure."""
    gate = threading.Event()
    failures = []

    def slow_factory():
        gate.wait(10)
        return FakeEngine()

    state = ServerState(ServerConfig(), engine_factory=slow_factory)
    app = build_app(state, on_load_failure=failures.append)

    async def start_and_stop():
        async with app.router.lifespan_context(app):  # what uvicorn runs: startup, then shutdown
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.1)  # the cancelled loading task finishes
        gate.set()  # the loading thread cannot be interrupted: let it end

    asyncio.run(start_and_stop())
    assert state.load_error is None and not failures
    assert not [r for r in caplog.records if "failed to load" in r.getMessage()]
