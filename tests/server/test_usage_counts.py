"""Usage counts: in streams (stream_options.include_usage: the final chunk; continuous_usage_stats, vLLM's: every
chunk carries its choice's running count) the same numbers a non-streaming answer gives, and /tokenize counting
a chat prompt as /v1/chat/completions renders it."""

import json

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine

CACHED = 3  # prompt tokens the scripted engine reports as served from the prefix cache


class CachingEngine(FakeEngine):
    """A FakeEngine whose outputs say part of the prompt came from the prefix cache."""

    async def generate(self, request_id, prompt_token_ids, params):
        async for out in super().generate(request_id, prompt_token_ids, params):
            out.num_cached_tokens = CACHED
            yield out


@pytest.fixture(scope="module")
def url():
    with serve_engine(CachingEngine(), max_n=4) as base:
        yield base


def post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def events(response):
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


CHAT = {"messages": [{"role": "user", "content": "SAY:hello"}]}
COMPLETION = {"prompt": "SAY:hello"}


def test_chat_stream_usage_matches_the_non_streaming_usage(url):
    whole = post(url, "/v1/chat/completions", {**CHAT, "n": 2}).json()["usage"]
    assert whole["prompt_tokens_details"] == {"cached_tokens": CACHED}
    chunks = events(post(url, "/v1/chat/completions", {**CHAT, "n": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_count_cached_prompt_tokens_once_per_prompt(url):
    body = {"prompt": ["SAY:hello", "SAY:bye"], "n": 2}
    whole = post(url, "/v1/completions", body).json()["usage"]
    assert whole["prompt_tokens_details"] == {"cached_tokens": 2 * CACHED}  # two prompts, each cached once
    chunks = events(post(url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole


@pytest.mark.parametrize("path,body,piece", [("/v1/chat/completions", CHAT, lambda c: c["delta"].get("content")),
                                             ("/v1/completions", COMPLETION, lambda c: c["text"])])
def test_continuous_usage_stats_count_each_choice_as_it_goes(url, path, body, piece):
    whole = post(url, path, body).json()["usage"]
    chunks = events(post(url, path, {**body, "n": 2, "stream": True,
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    *per_choice, final = chunks
    for index in (0, 1):
        mine = [c for c in per_choice if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        texts = ["".join(piece(c["choices"][0]) or "" for c in mine[:k + 1]) for k in range(len(mine))]
        # the fake engine makes one token per byte: the running count is the text so far
        assert counts == [len(t) for t in texts] and counts[-1] == whole["completion_tokens"]
        assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in mine)
        assert all(c["usage"]["total_tokens"] == whole["prompt_tokens"] + n for c, n in zip(mine, counts))
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2 * whole["completion_tokens"]


def test_continuous_usage_stats_without_include_usage_adds_nothing(url):
    chunks = events(post(url, "/v1/completions", {**COMPLETION, "stream": True,
                                                  "stream_options": {"continuous_usage_stats": True}}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "hello"  # chunks did come
    assert all("usage" not in c for c in chunks)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}, {"chat_template_kwargs": {"enable_thinking": True}},
                                   {"messages": [{"role": "user", "content": "SAY:hi"},
                                                 {"role": "assistant", "content": "Hel"}],
                                    "add_generation_prompt": False, "continue_final_message": True}])
def test_tokenize_counts_the_prompt_chat_completions_would_send(url, extra):
    body = {**CHAT, **extra}
    chat = post(url, "/v1/chat/completions", {**body, "max_tokens": 1}).json()["usage"]
    tokens = post(url, "/tokenize", body).json()
    assert tokens["count"] == chat["prompt_tokens"]


def test_tokenize_refuses_continue_final_message_with_a_generation_prompt(url):
    r = httpx.post(url + "/tokenize", json={**CHAT, "continue_final_message": True}, timeout=30)
    assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
