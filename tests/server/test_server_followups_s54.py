"""Server follow-ups of the fifty-fourth session.

A streamed chat answer sends its role chunks with the engine's first output (vLLM's order), not when the request
arrives: a client's first chunk (`vllm bench serve`'s time to first token) then times the prefill.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import httpx

from tests.server.fake_engine import FakeEngine, serve_engine


class GatedEngine(FakeEngine):
    """Holds every request before its first output until `gate` is set (a long prefill)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    async def generate(self, request_id, prompt_token_ids, params):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out


def _read_events(url: str, body: dict, events: queue.Queue) -> None:
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.put(line[len("data: "):])
    events.put(None)


def test_the_role_chunk_comes_with_the_first_output_not_before_the_prefill():
    engine = GatedEngine()
    body = {"model": "fake", "stream": True, "n": 2, "echo": False,
            "messages": [{"role": "user", "content": "SAY:hi"}]}
    with serve_engine(engine) as url:
        events: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_events, args=(url, body, events), daemon=True)
        reader.start()
        try:
            first = events.get(timeout=1.0)
        except queue.Empty:
            first = None
        assert first is None, f"a chunk came before the engine's first output: {first}"
        engine.gate.set()
        got = []
        while (event := events.get(timeout=30)) is not None:
            got.append(event)
        reader.join(timeout=10)
    chunks = [json.loads(e) for e in got if e != "[DONE]"]
    # both choices' role chunks first, then their content
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    for index in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"][0]["index"] == index)
        assert text == "hi"
    assert got[-1] == "[DONE]"
