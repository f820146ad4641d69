"""vLLM's `priority` (0 served, any other value a 400, as vLLM answers without priority scheduling; was ignored),
/tokenize's bound on a text too long for the context, and a 405's Allow header."""

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:ok"}]}),
    ("/v1/completions", {"prompt": "SAY:ok"}),
])
def test_priority_zero_is_served_and_another_is_refused(route, body):
    with serve_engine(FakeEngine()) as url:
        ok = httpx.post(f"{url}{route}", json={"model": "fake", "priority": 0, **body}, timeout=30)
        assert ok.status_code == 200, ok.text
        refused = httpx.post(f"{url}{route}", json={"model": "fake", "priority": -1, **body}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "no priority scheduling" in refused.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"prompt": "x" * 5000}, {"messages": [{"role": "user", "content": "x" * 5000}]}])
def test_tokenize_refuses_a_text_too_long_for_the_context_before_tokenizing(body):
    """/tokenize had no bound: a 6 MB prompt held the whole server for 9 s. It now takes the completion routes'
    check (a text longer than max_model_len x the longest token cannot fit)."""
    engine = FakeEngine(max_model_len=64)
    engine.tokenizer.get_vocab = lambda: {chr(i): i for i in range(256)}  # one character per token at most
    with serve_engine(engine) as url:
        r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == next(iter(body))
        ok = httpx.post(f"{url}/tokenize", json={"prompt": "x" * 10}, timeout=30)
        assert ok.status_code == 200 and ok.json()["count"] == 11  # BOS + 10 bytes


def test_a_wrong_method_says_which_are_allowed_and_health_answers_head():
    with serve_engine(FakeEngine()) as url:
        r = httpx.get(f"{url}/v1/chat/completions", timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
        assert httpx.head(f"{url}/health", timeout=10).status_code == 200  # was a 405
