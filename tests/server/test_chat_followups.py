"""Chat follow-ups: a constraint on a model whose template opens a thinking block (held after it), a cut in `</think>`, finish
reasons of calls cut by max_tokens, and harmony calls that hold no usable call (another function, a body that
is no JSON object, a message the model stopped in). Each asks the same thing streamed and not: both must agree."""

import json

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.reasoning_parser import HARMONY_MARKERS, FunctionMessage, ThinkReasoningParser
from radiance.server.state import ServerState
from radiance.server.tool_parsers import HarmonyToolParser
from tests.server.fake_engine import FakeEngine, serve_engine, serve_in_thread
from tests.server.test_harmony_tools import ANALYSIS, TOOLS, TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}  # the fake template then ends with <think>


def chat(url: str, body: dict, stream: bool) -> tuple[dict, str | None]:
    """(message fields, finish reason): a non-streamed message as it is, a streamed one summed from its deltas."""
    body = {"model": "fake", **body}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        message = {k: v for k, v in choice["message"].items() if k != "role" and v not in (None, "")}
        for call in message.get("tool_calls", ()):
            del call["id"]
        return message, choice["finish_reason"]
    message: dict = {}
    reason = None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                reason = choice["finish_reason"] or reason
                for key, value in choice["delta"].items():
                    if key == "tool_calls":
                        message.setdefault(key, []).extend(
                            {k: v for k, v in call.items() if k not in ("id", "index")} for call in value)
                    elif key != "role" and value:
                        message[key] = message.get(key, "") + value
    return message, reason


@pytest.fixture(scope="module")
def think_server():
    engine = FakeEngine(max_model_len=2048)
    with serve_engine(engine, reasoning_parser="think", tool_call_parser="hermes") as url:
        yield url, engine


def last_prompt(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


# --- 1. a constraint governs the answer, not the reasoning of a block the template opened ---

CONSTRAINTS = {
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "guided_json": {"guided_json": SCHEMA},
    "structured_outputs": {"structured_outputs": {"json": SCHEMA}},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", list(CONSTRAINTS))
def test_a_constraint_holds_the_answer_after_the_thinking_block_the_template_opened(think_server, field, stream):
    """vLLM's rule: the reasoning runs free, the constraint holds the text after </think> (the grammar itself:
    test_thinking_then_constraint.py)."""
    url, engine = think_server
    engine.reply = 'plan {"a": "x"}</think>\n\n{"a": 1}'
    body = {"messages": [{"role": "user", "content": "A?"}], **THINKING, **CONSTRAINTS[field]}
    assert chat(url, body, stream) == ({"content": '{"a": 1}', "reasoning_content": 'plan {"a": "x"}',
                                        "reasoning": 'plan {"a": "x"}'}, "stop")
    assert last_prompt(engine).endswith("<|assistant|><think>")  # the block stays open
    assert engine.requests[-1][2].structured_output.after_reasoning == "think"


@pytest.mark.parametrize("stream", [False, True])
def test_without_a_constraint_the_block_stays_open(think_server, stream):
    url, engine = think_server
    engine.reply = "plan</think>answer"
    body = {"messages": [{"role": "user", "content": "A?"}], **THINKING}
    message, _ = chat(url, body, stream)
    assert (message["content"], message["reasoning_content"]) == ("answer", "plan")
    assert last_prompt(engine).endswith("<|assistant|><think>")


def test_a_constraint_without_an_opened_block_leaves_the_prompt_as_rendered(think_server):
    url, engine = think_server
    engine.reply = '{"a": 1}'
    assert chat(url, {"messages": [{"role": "user", "content": "A?"}], **CONSTRAINTS["json_object"]}, False) == (
        {"content": '{"a": 1}'}, "stop")
    assert last_prompt(engine).endswith("<|assistant|>")


# --- 2. a cut inside </think>: the held-back text comes out, as reasoning (the block never closed) ---

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("opened_by", ["template", "model"])
@pytest.mark.parametrize("tools", [False, True])
def test_a_cut_inside_the_closing_tag_stays_reasoning(think_server, opened_by, tools, stream):
    url, engine = think_server
    engine.reply = ("" if opened_by == "template" else "<think>") + "plan</think>answer"
    cut = engine.reply.index("</think>") + len("</thi")
    body = {"messages": [{"role": "user", "content": "A?"}], "max_tokens": cut,
            **(THINKING if opened_by == "template" else {}), **({"tools": [WEATHER]} if tools else {})}
    message, reason = chat(url, body, stream)
    assert (message.get("content"), message.get("reasoning_content"), reason) == (None, "plan</thi", "length")


def test_every_cut_keeps_all_the_text():
    """Fed in pieces and finished at any cut, nothing of the output is lost but whole tags, and nothing of an
    unclosed block is content."""
    text = "<think>plan</think>answer"
    closed_at = text.index("</think>") + len("</think>")
    for cut in range(len(text) + 1):
        parser = ThinkReasoningParser()
        first, last = parser.feed(text[:cut]), parser.finish()
        got = (first.reasoning + last.reasoning, first.content + last.content)
        if cut < len("<think>"):
            want = ("", text[:cut])  # no block opened: a partial tag is text
        elif cut < closed_at:
            want = (text[len("<think>"):cut], "")
        else:
            want = ("plan", text[closed_at:cut])
        assert got == want, cut


# --- 3. a call cut by max_tokens: "length", never "tool_calls" ---

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_calls_cut_by_max_tokens_finish_with_length(think_server, stream):
    url, engine = think_server
    engine.reply = CALL + CALL.replace("Paris", "Rome")
    body = {"messages": [{"role": "user", "content": "A?"}], "tools": [WEATHER]}
    whole, reason = chat(url, body, stream)
    assert (len(whole["tool_calls"]), reason) == (2, "tool_calls")
    cut_in_second = len(CALL) + len('<tool_call>{"name": "get_weather", "arguments": {"city": "Ro')
    message, reason = chat(url, {**body, "max_tokens": cut_in_second}, stream)
    assert reason == "length"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"][:1]] == [{"city": "Paris"}]


# --- 3 and 4, harmony: a message that holds no usable call is content, as with the other markups ---

def harmony_call(name: str, body: str, end: str = "<|call|>") -> str:
    return (ANALYSIS + f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            + body + end)


@pytest.fixture(scope="module")
def harmony_server():
    engine = FakeEngine(chat_template=TOOLS_TEMPLATE, special_tokens=HARMONY_MARKERS)
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        yield url, engine


def harmony_chat(server, reply: str, stream: bool, **body) -> tuple[dict, str | None]:
    url, engine = server
    engine.reply = reply
    message, reason = chat(url, {"messages": [{"role": "user", "content": "X?"}], "tools": TOOLS, **body}, stream)
    assert message.pop("reasoning_content") == "Need the weather."
    message.pop("reasoning")
    return message, reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name, body", [
    ("get_time", '{"tz":"UTC"}'),  # a function the request did not offer
    ("get_weather", '["Paris"]'),  # arguments that are no object
    ("get_weather", '{"city":"Pa'),  # broken JSON
], ids=["unknown-function", "not-an-object", "broken-json"])
def test_a_harmony_message_with_no_usable_call_is_content(harmony_server, name, body, stream):
    assert harmony_chat(harmony_server, harmony_call(name, body), stream) == ({"content": body}, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_message_the_model_stopped_in_is_no_call(harmony_server, stream):
    """No <|call|>, no max_tokens: the model (or a stop string) ended the output inside the call's body."""
    assert harmony_chat(harmony_server, harmony_call("get_weather", '{"city":"Pa', end=""), stream) == (
        {"content": '{"city":"Pa'}, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_call_cut_by_max_tokens_finishes_with_length(harmony_server, stream):
    _, engine = harmony_server
    reply = harmony_call("get_weather", '{"city":"Paris"}')
    max_tokens = len(engine.tokenizer.encode(reply.replace('aris"}<|call|>', ""), add_special_tokens=False))
    message, reason = harmony_chat(harmony_server, reply, stream, max_tokens=max_tokens)
    assert (message, reason) == ({"tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"P'}}]}, "length")


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_call_to_an_offered_function_is_still_a_call(harmony_server, stream):
    message, reason = harmony_chat(harmony_server, harmony_call("get_weather", '{"city":"Paris"}'), stream)
    assert (message, reason) == ({"tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}}]}, "tool_calls")


def test_harmony_parser_reads_an_empty_body_as_no_arguments():
    parser = HarmonyToolParser(TOOLS + [{"type": "function", "function": {"name": "now", "parameters": {}}}])
    [call] = parser.function_message(FunctionMessage("now", "")).tool_calls
    assert (call.name, call.arguments, call.complete) == ("now", "{}", True)


@pytest.mark.parametrize("tool_choice, param", [(None, "tools"), ("auto", "tools"), ("required", "tool_choice")])
def test_tools_without_a_tool_call_parser_are_a_400_not_ignored(tool_choice, param):
    """With no parser the tools were dropped silently (a template without tool markup never shows them) and any
    call came out as text: a 400 naming the way out, as vLLM answers; tool_choice "none" still serves."""
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "SAY:hi"}], "tools": [WEATHER], "max_tokens": 4}
    with serve_engine(engine, tool_call_parser="none") as url:
        chosen = {} if tool_choice is None else {"tool_choice": tool_choice}
        r = httpx.post(url + "/v1/chat/completions", json={**body, **chosen}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--tool-call-parser" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/responses", json={"input": "SAY:hi", "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}, timeout=30)
        assert r.status_code == 400, r.text
        r = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
