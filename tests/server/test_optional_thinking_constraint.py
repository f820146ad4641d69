"""A constraint or a forced tool call on a template that does NOT open <think> while thinking is on (Qwen3's hybrid
template, DeepSeek-R1-style models: the model writes <think> itself), with the think reasoning parser: the model may
open a thinking block as its first text, which runs free, and the answer after </think> is held; a model that does
not think is held from its first token (vLLM applies the grammar only after </think>, so there such a model is never
held). The server splits the two (reasoning_content; content or tool_calls), streamed and not. Thinking off
(enable_thinking false, reasoning_effort none / minimal), a template whose thinking is opt-in, a continued message
and no reasoning parser keep the constraint from the start, as before. Grammars are checked by xgrammar over a small
real tokenizer (test_parser_followups.accepts)."""

import httpx
import pytest

from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_engine
from tests.server.test_chat_followups import SCHEMA, chat
from tests.server.test_parser_followups import accepts
from tests.server.test_thinking_then_constraint import (ASK, BAD_ARGUMENTS, CALLS, NAMED, PLAN, REQUIRED, TIME_TOOL,
                                                        TOOLS, calls_of, prompt_of, spec_of)
from tests.server.test_tool_parsers import WEATHER_TOOL

# Qwen3's hybrid template: thinking on by default with nothing opened in the prompt (the model writes <think>);
# with enable_thinking false the block is written closed
HYBRID = TEMPLATE.replace(
    "{% if enable_thinking %}<think>{% endif %}",
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def server(request):
    engine = FakeEngine(max_model_len=2048, chat_template=HYBRID)
    with serve_engine(engine, reasoning_parser="think", tool_call_parser=request.param) as url:
        yield url, engine, request.param


def thought(text: str) -> str:
    return "<think>" + PLAN + "</think>\n\n" + text


# --- response_format / structured_outputs: an optional block, then the held answer ---

CONSTRAINTS = [  # request fields, an answer that satisfies them, one that does not
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     '{"a": 1}', '{"a": "one"}'),
    ({"response_format": {"type": "json_object"}}, '{"a": 1}', "a is 1"),
    ({"guided_json": SCHEMA}, '{"a": 1}', '{"b": 1}'),
    ({"structured_outputs": {"regex": "(yes|no)"}}, "yes", "maybe"),
    ({"structured_outputs": {"choice": ["left", "right"]}}, "right", "up"),
    ({"structured_outputs": {"grammar": 'root ::= "A" [0-9]+'}}, "A42", "B42"),
]
IDS = ["json_schema", "json_object", "guided_json", "regex", "choice", "grammar"]


@pytest.mark.parametrize("fields, good, bad", CONSTRAINTS, ids=IDS)
def test_the_grammar_lets_an_optional_block_run_and_holds_the_answer(server, fields, good, bad):
    url, engine, _ = server
    engine.reply = thought(good)
    chat(url, {"messages": ASK, **fields}, False)
    assert prompt_of(engine).endswith("<|assistant|>")  # the prompt as rendered
    spec = spec_of(engine)
    assert spec.after_reasoning == "optional_think"
    assert accepts(spec, thought(good))
    assert accepts(spec, good)  # a model that does not think is held from its first token
    assert accepts(spec, "<think></think>" + good)
    assert not accepts(spec, PLAN + " " + good)  # reasoning without the tags is no reasoning
    assert not accepts(spec, PLAN + "</think>\n\n" + good)  # the prompt opened no block: the model opens it
    assert not accepts(spec, thought(bad))  # the answer after the block is held
    assert not accepts(spec, bad)
    assert not accepts(spec, thought(good) + " and more")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, good, bad", CONSTRAINTS, ids=IDS)
def test_reasoning_and_the_held_answer_come_apart(server, fields, good, bad, stream):
    url, engine, _ = server
    engine.reply = thought(good)
    assert chat(url, {"messages": ASK, **fields}, stream) == (
        {"reasoning_content": PLAN, "reasoning": PLAN, "content": good}, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_thinking_is_all_content(server, stream):
    url, engine, _ = server
    engine.reply = '{"a": 1}'
    assert chat(url, {"messages": ASK, "response_format": {"type": "json_object"}}, stream) == (
        {"content": '{"a": 1}'}, "stop")


def test_the_responses_api_keeps_the_reasoning_item(server):
    url, engine, _ = server
    engine.reply = thought('{"a": 1}')
    r = httpx.post(url + "/v1/responses", timeout=30, json={
        "model": "fake", "input": "A?", "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [item["type"] for item in out] == ["reasoning", "message"]
    assert (out[0]["content"][0]["text"], out[1]["content"][0]["text"]) == (PLAN, '{"a": 1}')
    assert spec_of(engine).after_reasoning == "optional_think"


# --- forced tool calls: no call markup at the end of the prompt; the model writes the whole call ---

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("thinks", [True, False], ids=["thinks", "no-thinking"])
@pytest.mark.parametrize("choice", [REQUIRED, NAMED], ids=["required", "named"])
def test_a_forced_call_after_an_optional_block_becomes_tool_calls(server, choice, thinks, stream):
    url, engine, parser = server
    engine.reply = thought(CALLS[parser]) if thinks else CALLS[parser]
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **choice}, stream)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"})]
    assert message.get("content") is None
    assert message.get("reasoning_content") == (PLAN if thinks else None)
    assert reason == ("stop" if choice is NAMED else "tool_calls")  # OpenAI: a named call finishes with stop
    assert prompt_of(engine).endswith("<|assistant|>")  # no call markup in the prompt


@pytest.mark.parametrize("choice", [REQUIRED, NAMED], ids=["required", "named"])
def test_the_forced_call_grammar_holds_the_whole_call_after_an_optional_block(server, choice):
    url, engine, parser = server
    call = CALLS[parser]
    engine.reply = thought(call)
    chat(url, {"messages": ASK, "tools": TOOLS, **choice}, False)
    spec = spec_of(engine)
    assert spec.after_reasoning == "optional_think"
    assert accepts(spec, thought(call)) and accepts(spec, call)
    assert not accepts(spec, PLAN + "</think>\n\n" + call)
    assert not accepts(spec, thought("No call needed."))  # the answer is a call
    assert not accepts(spec, "No call needed.")
    assert not accepts(spec, thought(BAD_ARGUMENTS[parser]))  # held to the function's schema
    assert not accepts(spec, BAD_ARGUMENTS[parser])
    assert not accepts(spec, thought(call.replace("get_weather", "get_date")))  # no such tool
    opening = call[:call.index("get_weather")]
    assert not accepts(spec, call[len(opening):])  # the opening is the model's to write


def test_parallel_required_calls_after_an_optional_block(server):
    url, engine, parser = server
    call = CALLS[parser]
    engine.reply = thought(call + "\n" + call.replace("Oslo", "Rome"))
    message, reason = chat(url, {"messages": ASK, "tools": TOOLS, **REQUIRED}, False)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert reason == "tool_calls" and accepts(spec_of(engine), engine.reply)


# --- strict tools under "auto": calls are held after the optional block, the reasoning is free ---

def test_strict_tools_hold_the_calls_after_an_optional_block(server):
    url, engine, parser = server
    strict = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    call = CALLS[parser]
    engine.reply = thought(call)
    message, reason = chat(url, {"messages": ASK, "tools": [strict, TIME_TOOL]}, False)
    assert calls_of(message) == [("get_weather", {"city": "Oslo"})] and message["reasoning_content"] == PLAN
    spec = spec_of(engine)
    assert spec.after_reasoning == "optional_think"
    assert accepts(spec, thought(call)) and accepts(spec, call) and accepts(spec, "Sunny.")
    assert not accepts(spec, thought(BAD_ARGUMENTS[parser]))


# --- thinking off, opt-in thinking, a continued message: the constraint holds from the start, as before ---

OFF = [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
       {"reasoning_effort": "minimal"}]
OFF_IDS = ["enable_thinking", "effort-none", "effort-minimal"]


@pytest.mark.parametrize("off", OFF, ids=OFF_IDS)
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


@pytest.mark.parametrize("off", OFF, ids=OFF_IDS)
def test_thinking_off_holds_the_whole_answer(server, off):
    url, engine, _ = server
    engine.reply = '{"a": 1}'
    message, _ = chat(url, {"messages": ASK, "response_format": {"type": "json_object"}, **off}, False)
    assert message == {"content": '{"a": 1}'}
    assert prompt_of(engine).endswith("<think>\n\n</think>\n\n")
    spec = spec_of(engine)
    assert spec.after_reasoning is None and not accepts(spec, thought('{"a": 1}'))


def test_a_block_the_template_closed_is_thinking_off():
    """A template that writes the block closed by itself (DeepSeek-V3.1 without thinking, or any other switch than
    enable_thinking): the model starts on its answer, held from the start."""
    engine = FakeEngine(max_model_len=2048, chat_template=TEMPLATE.replace(
        "{% if enable_thinking %}<think>{% endif %}", "{% if not thinking %}</think>{% endif %}"))
    engine.reply = '{"a": 1}'
    with serve_engine(engine, reasoning_parser="think", tool_call_parser="hermes") as url:
        assert chat(url, {"messages": ASK, "response_format": {"type": "json_object"}}, False) == (
            {"content": '{"a": 1}'}, "stop")
        assert spec_of(engine).after_reasoning is None and prompt_of(engine).endswith("<|assistant|></think>")
        chat(url, {"messages": ASK, "response_format": {"type": "json_object"},
                   "chat_template_kwargs": {"thinking": True}}, False)
        assert spec_of(engine).after_reasoning == "optional_think"


def test_opt_in_thinking_left_off_keeps_the_old_constraint():
    """A template that opens <think> only when asked (enable_thinking): not asked, the model does not think, so the
    forced call's opening stays at the end of the prompt and the constraint holds from the start."""
    engine = FakeEngine(max_model_len=2048)  # TEMPLATE: <think> only with enable_thinking
    call = CALLS["hermes"]
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    engine.reply = call[len(opening):]
    with serve_engine(engine, reasoning_parser="think", tool_call_parser="hermes") as url:
        message, _ = chat(url, {"messages": ASK, "tools": TOOLS, **NAMED}, False)
        assert calls_of(message) == [("get_weather", {"city": "Oslo"})]
        assert prompt_of(engine).endswith("<|assistant|>" + opening) and spec_of(engine).after_reasoning is None
        engine.reply = '{"a": 1}'
        chat(url, {"messages": ASK, "response_format": {"type": "json_object"}}, False)
        assert spec_of(engine).after_reasoning is None


def test_a_continued_message_is_held_from_the_start(server):
    url, engine, _ = server
    engine.reply = "es"
    messages = ASK + [{"role": "assistant", "content": "y"}]
    message, _ = chat(url, {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
                            "structured_outputs": {"regex": "(es|o)"}}, False)
    assert message == {"content": "es"} and spec_of(engine).after_reasoning is None


def test_without_a_reasoning_parser_nothing_changes():
    engine = FakeEngine(max_model_len=2048, chat_template=HYBRID)
    engine.reply = '{"a": 1}'
    with serve_engine(engine, reasoning_parser="none", tool_call_parser="hermes") as url:
        assert chat(url, {"messages": ASK, "response_format": {"type": "json_object"}}, False) == (
            {"content": '{"a": 1}'}, "stop")
    assert prompt_of(engine).endswith("<|assistant|>") and spec_of(engine).after_reasoning is None
