"""Fixtures of the bench tests. A tiny OpenAI-compatible streaming server for testing the load generator: it emits exactly
max_tokens chunks with a known first-token delay and token gap, fails prompts containing FAIL and streams a
non-object event for prompts containing GARBLE."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_GAP_S = 0.01
MODEL = "fake-model"


def build_app(max_in_flight: list[int]) -> FastAPI:
    app = FastAPI()
    in_flight = [0]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def stream(body: dict, chat: bool):
        in_flight[0] += 1
        max_in_flight[0] = max(max_in_flight[0], in_flight[0])
        try:
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            n = int(body["max_tokens"])
            for i in range(n):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            in_flight[0] -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}},
                                status_code=500)
        if "GARBLE" in prompt:
            return StreamingResponse(iter(["data: [1, 2]\n\n", "data: [DONE]\n\n"]), media_type="text/event-stream")
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Runs the app with uvicorn on a background thread; `.url`, `.max_in_flight[0]`."""

    first_token_delay_s = FIRST_TOKEN_DELAY_S
    token_gap_s = TOKEN_GAP_S
    model = MODEL

    def __init__(self):
        self.max_in_flight = [0]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(self.max_in_flight), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_server():
    with FakeServer() as server:
        yield server
