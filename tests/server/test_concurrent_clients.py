"""Many clients at once against the scripted engine: every answer is its own request's (no mix-ups between
concurrent requests or their choices), side routes answer meanwhile, and clients that hang up mid-way free all
their choices' engine requests."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, max_n=4) as url:
        yield url, engine


def sse_texts(text: str, field) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[len("data: "):])["choices"]:
                out[choice["index"]] = out.get(choice["index"], "") + (field(choice) or "")
    return out


async def chat(client, k: int, stream: bool) -> tuple[str, dict[int, str]]:
    say = f"reply number {k}"
    body = {"messages": [{"role": "user", "content": "SAY:" + say}], "n": 2, "stream": stream}
    r = await client.post("/v1/chat/completions", json=body)
    if stream:
        return say, sse_texts(r.text, lambda c: c["delta"].get("content"))
    return say, {c["index"]: c["message"]["content"] for c in r.json()["choices"]}


async def completion(client, k: int, stream: bool) -> tuple[str, dict[int, str]]:
    prompts = [f"SAY:first {k}", f"SAY:second {k}"]
    r = await client.post("/v1/completions", json={"prompt": prompts, "n": 2, "stream": stream})
    if stream:
        return f"{k}", sse_texts(r.text, lambda c: c["text"])
    return f"{k}", {c["index"]: c["text"] for c in r.json()["choices"]}


async def side_route(client, k: int) -> tuple[str, object]:
    text = f"tokens {k}"
    ids = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    back = (await client.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    statuses = [(await client.get(path)).status_code for path in ("/health", "/metrics", "/version", "/v1/models")]
    return text, (back, statuses)


def test_concurrent_requests_each_get_their_own_answer(server):
    async def run():
        async with httpx.AsyncClient(base_url=server[0], timeout=30) as client:
            jobs = [f(client, k, k % 2 == 0) for k in range(12) for f in (chat, completion)]
            jobs += [side_route(client, k) for k in range(12)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for want, got in results[:24:2]:  # chat: both choices say the request's own reply
        assert got == {0: want, 1: want}
    for k, got in results[1:24:2]:  # completions: choice index = prompt index * n + choice
        assert got == {0: f"first {k}", 1: f"first {k}", 2: f"second {k}", 3: f"second {k}"}
    for text, (back, statuses) in results[24:]:
        assert back == text and statuses == [200, 200, 200, 200]
    assert not server[1].active


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_way_frees_every_choice(server, stream):
    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({"messages": [{"role": "user", "content": "SAY:SLOW" + "z" * 100}], "n": 3,
                       "stream": stream}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    try:
        assert wait_for(lambda: len(engine.active) == 3)
        started = set(engine.active)
    finally:
        sock.close()
    assert wait_for(lambda: not engine.active), engine.active
    assert started <= set(engine.aborted)


def test_one_model_card_is_the_card_the_list_gives(server):
    listed = httpx.get(server[0] + "/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["fake"]  # an empty list passed the loop below
    for card in listed:
        assert httpx.get(server[0] + "/v1/models/" + card["id"]).json() == card
