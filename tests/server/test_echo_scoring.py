"""/v1/completions with echo and max_tokens 0 scores the prompt (vLLM's echo without generation, what prompt-scoring
clients such as lm-evaluation-harness send): the answer is the prompt with its logprobs, finish_reason length, no
output token in text, logprobs or usage; the engine runs one token to score it, which is dropped."""

from __future__ import annotations

import json

import pytest

from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http

PROMPT = "SAY:hello there"


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with serve_engine(engine) as url:
        yield url, engine


def _body(**fields):
    return {"model": "fake", "prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, **fields}


def test_the_answer_is_the_scored_prompt_and_nothing_generated(served):
    r = http(served, "POST", "/v1/completions", _body(), key=None)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    prompt_ids = served[1].requests[-1][1]
    assert served[1].requests[-1][2].max_tokens == 1  # one token to score the prompt with
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids)  # the prompt's tokens alone: the generated one is dropped
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:] == [-1.0] * (len(prompt_ids) - 1)
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompt_ids)


def test_streamed_the_same(served):
    r = http(served, "POST", "/v1/completions", _body(stream=True, stream_options={"include_usage": True}),
             key=None)
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == len(served[1].requests[-1][1])
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_1_still_generates(served):
    r = http(served, "POST", "/v1/completions", _body(max_tokens=1), key=None)
    assert r.json()["choices"][0]["text"] == PROMPT + "h" and r.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_0_without_echo_is_a_400(served):
    r = http(served, "POST", "/v1/completions", _body(echo=False), key=None)
    check_error_shape(r, 400, "max_tokens")
    assert "echo" in r.json()["error"]["message"]
