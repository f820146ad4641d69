"""Chat follow-ups from a black-box hunt: vLLM's `echo` (the answer starts with the last message's content when that
message is the assistant's, the one continue_final_message continues; was ignored), logprobs asked for are never
null, and parallel_tool_calls false keeps the first call."""

import json

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine

CONTINUED = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "SAY:one two"}]


def _chat(url, messages, **fields):
    body = {"model": "fake", "messages": messages, "max_tokens": 32, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def _streamed_contents(response) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_continued_message_before_the_answer(stream):
    """The fake engine answers the text after the prompt's last SAY:, here "one two"."""
    fields = {"echo": True, "add_generation_prompt": False, "continue_final_message": True, "n": 2, "stream": stream}
    with serve_engine(FakeEngine()) as url:
        r = _chat(url, CONTINUED, **fields)
        assert r.status_code == 200, r.text
        if stream:
            texts = _streamed_contents(r)
        else:
            texts = {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
            assert r.json()["usage"]["completion_tokens"] == 2 * len("one two")  # the echo is not generated
        assert texts == {0: "SAY:one twoone two", 1: "SAY:one twoone two"}
        without = _chat(url, CONTINUED, **dict(fields, echo=False))
        assert (_streamed_contents(without) if stream else
                {c["index"]: c["message"]["content"] for c in without.json()["choices"]}) == {0: "one two", 1: "one two"}


def test_echo_after_a_user_message_adds_nothing():
    with serve_engine(FakeEngine()) as url:
        r = _chat(url, [{"role": "user", "content": "SAY:hello"}], echo=True)
        assert r.json()["choices"][0]["message"]["content"] == "hello"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_logprobs_asked_for_are_there_when_no_token_goes_out(route):
    """A stop string on the first token leaves no text: logprobs were null, and `choice.logprobs.content` raised
    in clients (OpenAI answers an empty list)."""
    with serve_engine(FakeEngine()) as url:
        if route == "chat":
            r = _chat(url, [{"role": "user", "content": "SAY:hello"}], logprobs=True, top_logprobs=1, stop=["h"])
            assert r.json()["choices"][0]["message"]["content"] == ""
            assert r.json()["choices"][0]["logprobs"] == {"content": []}
            lp = _chat(url, [{"role": "user", "content": "SAY:hello"}], logprobs=True).json()["choices"][0]
            assert "".join(e["token"] for e in lp["logprobs"]["content"]) == "hello"
            assert _chat(url, [{"role": "user", "content": "SAY:hello"}]).json()["choices"][0]["logprobs"] is None
        else:
            body = {"model": "fake", "prompt": "SAY:hello", "logprobs": 1, "stop": ["h"], "max_tokens": 8}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
            assert r["text"] == "" and r["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                         "text_offset": []}
            body.pop("stop")
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
            assert "".join(r["logprobs"]["tokens"]) == r["text"] == "hello"


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(stream, parallel):
    """A model that writes two calls under tool_choice "auto" (non-strict tools: nothing constrains it) gave both
    with parallel_tool_calls false; OpenAI answers one at most."""
    engine = FakeEngine()
    engine.reply = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                    '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    with serve_engine(engine) as url:
        r = _chat(url, [{"role": "user", "content": "go"}], tools=[_tool("a"), _tool("b")],
                  parallel_tool_calls=parallel, stream=stream, max_tokens=200)
        assert r.status_code == 200, r.text
        if stream:
            calls = [c for line in r.text.splitlines() if line.startswith("data: {")
                     for choice in json.loads(line[6:])["choices"] for c in choice["delta"].get("tool_calls") or []]
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == (["a", "b"] if parallel else ["a"])
        if stream:  # a streamed call's place among the calls
            assert [c["index"] for c in calls] == ([0, 1] if parallel else [0])
