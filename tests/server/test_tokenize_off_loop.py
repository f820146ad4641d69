"""Rendering and tokenizing a prompt run on the server's tokenizer thread, not the event loop: a long prompt
(~1 s for 600k characters on a 2-core CPU) held up /health and every other request's stream meanwhile. Prompts
still take their turn on that one thread (as vLLM's tokenizer executor), so the tokenizer is never entered twice
at once."""

import threading
import time

import httpx
import pytest

from tests.server.fake_engine import ByteTokenizer, FakeEngine, serve_engine

SLOW_SECONDS = 1.5


class SlowTokenizer(ByteTokenizer):
    """Sleeps (letting go of the GIL, as the Rust tokenizer does while it encodes) on a text holding SLOW."""

    def encode(self, text, add_special_tokens=True):
        if "SLOW" in text:
            time.sleep(SLOW_SECONDS)
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"prompt": "SLOW"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "SLOW"}]}),
    ("/v1/completions", {"model": "fake", "prompt": "SAY:SLOW", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "SAY:SLOW"}]}),
])
def test_other_requests_are_answered_while_a_prompt_is_tokenized(route, body):
    engine = FakeEngine()
    engine.tokenizer = SlowTokenizer()
    with serve_engine(engine) as url:
        slow = {}

        def send():
            start = time.perf_counter()
            slow["response"] = httpx.post(url + route, json=body, timeout=30)
            slow["seconds"] = time.perf_counter() - start

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.3)  # the slow request is being tokenized
        start = time.perf_counter()
        health = httpx.get(url + "/health", timeout=30)
        models = httpx.get(url + "/v1/models", timeout=30)
        waited = time.perf_counter() - start
        sender.join()
        assert health.status_code == 200 and models.json()["data"][0]["id"] == "fake"
        assert slow["response"].status_code == 200, slow["response"].text
        assert slow["seconds"] >= SLOW_SECONDS  # not vacuous: the tokenizer did hold the slow request
        assert waited < SLOW_SECONDS / 2, f"/health and /v1/models waited {waited:.2f} s"


def test_tokenize_names_the_tokens_when_asked():
    """vLLM's return_token_strs: token_strs beside the ids (a tokenizer without vocabulary names: their text)."""
    with serve_engine(FakeEngine()) as url:
        r = httpx.post(url + "/tokenize", json={"prompt": "hé", "return_token_strs": True}, timeout=30).json()
        assert r["tokens"] == [256, ord("h"), 0xC3, 0xA9] and len(r["token_strs"]) == 4
        assert r["token_strs"][1] == "h"
        plain = httpx.post(url + "/tokenize", json={"prompt": "hé"}, timeout=30).json()
        assert "token_strs" not in plain and plain["tokens"] == r["tokens"]
