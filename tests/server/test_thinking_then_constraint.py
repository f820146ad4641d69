"""A constraint or a forced tool call on a template that opens <think> (Qwen3 thinking models): the reasoning runs
free and the answer after </think> is held to the constraint, as vLLM applies a grammar only once its reasoning
parser saw the reasoning end. The server splits the two (reasoning_content; content or tool_calls), streamed and
not; with thinking off (enable_thinking false, reasoning_effort none) the prompt and the constraint are as before.
The grammars are checked by xgrammar over a small real tokenizer (test_parser_followups.accepts)."""

import json

import httpx
import pytest

from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_engine
from tests.server.test_chat_followups import SCHEMA, THINKING, chat
from tests.server.test_parser_followups import accepts
from tests.server.test_tool_parsers import WEATHER_TOOL

# a Qwen3 thinking template: the prompt opens <think> unless thinking is off (then the block is written closed)
QWEN_THINKING = TEMPLATE.replace(
    "{% if enable_thinking %}<think>{% endif %}",
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}")
PLAN = 'Let me think. Maybe {"a": "x"}, or <tool_call> get_time?'  # JSON, markup: the reasoning is free text
ASK = [{"role": "user", "content": "A?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                   "</tool_call>",
}
BAD_ARGUMENTS = {  # the same call, its arguments against the schema (days is an integer)
    "hermes": CALLS["hermes"].replace('"Oslo"', '"Oslo", "days": "two"'),
    "qwen3_coder": CALLS["qwen3_coder"].replace("<parameter=city>\nOslo", "<parameter=days>\ntwo"),
}
REQUIRED = {"tool_choice": "required"}
NAMED = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def server(request):
    engine = FakeEngine(max_model_len=2048, chat_template=QWEN_THINKING)
    with serve_engine(engine, reasoning_parser="think", tool_call_parser=request.param) as url:
        yield url, engine, request.param


def prompt_of(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def spec_of(engine: FakeEngine):
    return engine.requests[-1][2].structured_output


def calls_of(message: dict) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", ())]


# --- response_format / structured_outputs: the answer after </think> is held, the reasoning is not ---

CONSTRAINTS = [  # request fields, an answer that satisfies them, one that does not
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     '{"a": 1}', '{"a": "one"}'),
    ({"response_format": {"type": "json_object"}}, '{"a": 1}', "a is 1"),
    ({"structured_outputs": {"regex": "(yes|no)"}}, "yes", "maybe"),
    ({"structured_outputs": {"choice": ["left", "right"]}}, "right", "up"),
    ({"structured_outputs": {"grammar": 'root ::= "A" [0-9]+'}}, "A42", "B42"),
]
IDS = ["json_schema", "json_object", "regex", "choice", "grammar"]


@pytest.mark.parametrize("fields, good, bad", CONSTRAINTS, ids=IDS)
def test_the_grammar_lets_the_reasoning_run_and_holds_the_answer(server, fields, good, bad):
    url, engine, _ = server
    engine.reply = PLAN + "</think>\n\n" + good
    chat(url, {"messages": ASK, **fields}, False)
    assert prompt_of(engine).endswith("<|assistant|><think>\n")  # the block stays open
    spec = spec_of(engine)
    assert accepts(spec, PLAN + "</think>\n\n" + good)
    assert accepts(spec, "</think>" + good)  # no reasoning at all, no whitespace
    assert not accepts(spec, good)  # the answer is not the reasoning: the block must end first
    assert not accepts(spec, PLAN + "</think>\n\n" + bad)  # the answer is held
    assert not accepts(spec, PLAN + "</think>\n\n" + good + " and more")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, good, bad", CONSTRAINTS, ids=IDS)
def test_reasoning_and_the_held_answer_come_apart(server, fields, good, bad, stream):
    url, engine, _ = server
    engine.reply = PLAN + "</think>\n\n" + good
    assert chat(url, {"messages": ASK, **fields}, stream) == (
        {"reasoning_content": PLAN, "reasoning": PLAN, "content": good}, "stop")


def test_the_responses_api_keeps_the_reasoning_item(server):
    url, engine, _ = server
    engine.reply = PLAN + "</think>\n\n" + '{"a": 1}'
    r = httpx.post(url + "/v1/responses", timeout=30, json={
        "model": "fake", "input": "A?", "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [item["type"] for item in out] == ["reasoning", "message"]
    assert (out[0]["content"][0]["text"], out[1]["content"][0]["text"]) == (PLAN, '{"a": 1}')
    assert spec_of(engine).after_reasoning == "think"


# --- forced tool calls: the call's opening is not in the prompt; the model writes the call after </think> ---

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [REQUIRED, NAMED], ids=["required", "named"])
def test_a_forced_call_after_thinking_becomes_tool_calls(server, choice, stream):
    url, engine, parser = server
    engine.reply = PLAN + "</think>\n\n" + CALLS[parser]
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **choice}, stream)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"})]
    assert (message.get("content"), message["reasoning_content"]) == (None, PLAN)
    assert reason == ("stop" if choice is NAMED else "tool_calls")  # OpenAI: a named call finishes with stop
    assert prompt_of(engine).endswith("<|assistant|><think>\n")  # no call markup after the open block


@pytest.mark.parametrize("choice", [REQUIRED, NAMED], ids=["required", "named"])
def test_the_forced_call_grammar_holds_the_call_after_the_reasoning(server, choice):
    url, engine, parser = server
    call = CALLS[parser]
    engine.reply = PLAN + "</think>\n\n" + call
    chat(url, {"messages": ASK, "tools": TOOLS, **choice}, False)
    spec = spec_of(engine)
    assert accepts(spec, PLAN + "</think>\n\n" + call)
    assert not accepts(spec, call)  # a call is no reasoning: the block ends first
    assert not accepts(spec, PLAN + "</think>\n\nNo call needed.")  # the answer is a call
    assert not accepts(spec, PLAN + "</think>\n\n" + BAD_ARGUMENTS[parser])  # held to the function's schema
    assert not accepts(spec, PLAN + "</think>\n\n" + call.replace("get_weather", "get_date"))  # no such tool
    if choice is NAMED:
        time_call = call.replace("get_weather", "get_time").replace('{"city": "Oslo"}', "{}").replace(
            "<parameter=city>\nOslo\n</parameter>\n", "")
        assert not accepts(spec, PLAN + "</think>\n\n" + time_call)  # the named function only


def test_parallel_required_calls_after_thinking(server):
    url, engine, parser = server
    call = CALLS[parser]
    engine.reply = PLAN + "</think>\n\n" + call + "\n" + call.replace("Oslo", "Rome")
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **REQUIRED}, False)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert reason == "tool_calls" and accepts(spec_of(engine), engine.reply)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_spent_on_reasoning_ends_without_a_call(server, stream):
    """The reasoning counts against max_tokens, as in vLLM: cut inside it, the answer is reasoning, no call."""
    url, engine, parser = server
    engine.reply = PLAN + "</think>\n\n" + CALLS[parser]
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **REQUIRED, "max_tokens": 10}, stream)
    assert (message, reason) == ({"reasoning_content": PLAN[:10], "reasoning": PLAN[:10]}, "length")


# --- thinking off: nothing changes (the prompt ends with the call's opening, the constraint holds from the start) ---

OFF = [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
       {"reasoning_effort": "minimal"}]


@pytest.mark.parametrize("off", OFF, ids=["enable_thinking", "effort-none", "effort-minimal"])
def test_thinking_off_keeps_the_forced_prefix_in_the_prompt(server, off):
    url, engine, parser = server
    call = CALLS[parser]
    opening = call[:call.index("get_weather") + len("get_weather")] + ('", "arguments": ' if parser == "hermes"
                                                                        else ">\n")
    engine.reply = call[len(opening):]
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **NAMED, **off}, False)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"})] and "reasoning_content" not in message
    assert prompt_of(engine).endswith("<think>\n\n</think>\n\n" + opening)
    assert spec_of(engine).after_reasoning is None and accepts(spec_of(engine), engine.reply)


@pytest.mark.parametrize("off", OFF, ids=["enable_thinking", "effort-none", "effort-minimal"])
def test_thinking_off_holds_the_whole_answer(server, off):
    url, engine, _ = server
    engine.reply = '{"a": 1}'
    message, _ = chat(url, {"messages": ASK, "response_format": {"type": "json_object"}, **off}, False)
    assert message == {"content": '{"a": 1}'}
    assert prompt_of(engine).endswith("<think>\n\n</think>\n\n") and spec_of(engine).after_reasoning is None


# --- no reasoning parser to split the reasoning off: the block is closed empty first, as before ---

def test_without_a_reasoning_parser_the_block_is_closed_first():
    engine = FakeEngine(max_model_len=2048)
    engine.reply = '{"a": 1}'
    with serve_engine(engine, reasoning_parser="none", tool_call_parser="hermes") as url:
        body = {"messages": ASK, **THINKING, "response_format": {"type": "json_object"}}
        assert chat(url, body, False) == ({"content": '{"a": 1}'}, "stop")
    assert prompt_of(engine).endswith("<|assistant|><think>\n</think>\n\n")
    assert spec_of(engine).after_reasoning is None
