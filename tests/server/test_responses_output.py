"""/v1/responses output items against OpenAI's shape, beyond test_responses.py: the logprobs of a message are
those of its own text's tokens."""

import json

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object",
                                                                     "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def url():
    with serve_engine(FakeEngine(max_model_len=1024)) as url:
        yield url


def _respond(url, stream, **fields):
    body = {"model": "fake", "stream": stream, "include": ["message.output_text.logprobs"], **fields}
    if not stream:
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json(), []
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    return events[-1]["response"], events


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("said,fields,text", [
    ("plan</think>Checking.", {"chat_template_kwargs": {"enable_thinking": True}}, "Checking."),
    ("Checking." + CALL, {"tools": TOOLS}, "Checking."),
    ("Before." + CALL + "After.", {"tools": TOOLS}, "Before.After."),
    ("a<b and c", {"tools": TOOLS}, "a<b and c"),  # "<" held back (a call's start?), then given as text
])
def test_message_logprobs_are_those_of_its_text(url, stream, said, fields, text):
    """The message's logprobs spell its text, in both modes, and the stream's deltas carry the same; the
    reasoning's and the call's tokens (and "</think>", "<tool_call>") went into the message's logprobs."""
    body, events = _respond(url, stream, input="SAY:" + said, **fields)
    messages = [item for item in body["output"] if item["type"] == "message"]
    assert "".join(m["content"][0]["text"] for m in messages) == text
    logprobs = [e for m in messages for e in m["content"][0]["logprobs"]]
    assert "".join(e["token"] for e in logprobs) == text
    if stream:
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [e for d in deltas for e in d["logprobs"]] == logprobs
        for done in (e for e in events if e["type"] == "response.output_text.done"):
            assert "".join(e["token"] for e in done["logprobs"]) == done["text"]
