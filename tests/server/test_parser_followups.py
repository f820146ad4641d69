"""Parser and constraint follow-ups: gpt-oss's response_format holds the final message's body (its analysis runs
free), a harmony message to a built-in tool is reasoning (no call, no markup in the answer), a function message's
body that became text is set apart from its neighbours in its place, a Qwen3-coder call the model stopped in
before </function> is text, and strict tools on a template that opens <think> hold the calls from </think> on."""

import functools
import json
from types import SimpleNamespace

import pytest

from radiance.engine.structured_output import GrammarBackend
from radiance.server.reasoning_parser import HarmonyReasoningParser, split_reasoning
from radiance.server.serving_chat import ChoiceStream
from radiance.server.tool_parsers import Qwen3CoderToolParser, parse_tool_calls
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server import test_chat_followups
from tests.server.test_chat_followups import SCHEMA, THINKING, chat
from tests.server.test_harmony_tools import ANALYSIS, TOOLS
from tests.server.test_tool_parsers import WEATHER_TOOL

harmony_server = test_chat_followups.harmony_server  # the fixture, shared


@functools.cache
def backend() -> GrammarBackend:
    """The engine's grammar compiler over a small real tokenizer: what a constraint lets through, as text."""
    tokenizer = tiny_byte_bpe_tokenizer()
    return GrammarBackend(tokenizer, TINY_TOKENIZER_VOCAB, [tokenizer.eos_token_id])


def accepts(spec, text: str) -> bool:
    """The constraint lets the model write `text` and end there."""
    matcher = backend().matcher(spec).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def splits(text: str):
    """The text whole, one character at a time, and cut in two at every place."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


# --- 1. gpt-oss: response_format holds the final message's body, after any analysis ---

FINAL = '<|start|>assistant<|channel|>final<|message|>{"a": 1}'
HARMONY_CONSTRAINTS = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "guided_json": {"guided_json": SCHEMA},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", list(HARMONY_CONSTRAINTS))
def test_harmony_response_format_holds_the_final_message(harmony_server, field, stream):
    url, engine = harmony_server
    engine.reply = ANALYSIS + FINAL + "<|return|>"
    body = {"messages": [{"role": "user", "content": "A?"}], **HARMONY_CONSTRAINTS[field]}
    assert chat(url, body, stream) == ({"content": '{"a": 1}', "reasoning_content": "Need the weather.",
                                        "reasoning": "Need the weather."}, "stop")
    spec = engine.requests[-1][2].structured_output
    assert accepts(spec, ANALYSIS + FINAL)  # the analysis runs free, then the final channel's header
    assert accepts(spec, FINAL.removeprefix("<|start|>assistant"))  # no analysis at all
    assert not accepts(spec, '{"a": 1}')  # JSON right after <|start|>assistant is no harmony message
    assert not accepts(spec, "<|channel|>commentary<|message|>" + '{"a": 1}')
    if field != "json_object":
        assert not accepts(spec, ANALYSIS + FINAL.replace("1", '"x"'))  # the body is held to the schema


def test_harmony_response_format_lets_an_analysis_leave_only_by_its_end(harmony_server):
    """A header inside an analysis message would start a final message the grammar thinks is still analysis."""
    url, engine = harmony_server
    engine.reply = ANALYSIS + FINAL + "<|return|>"
    chat(url, {"messages": [{"role": "user", "content": "A?"}], **HARMONY_CONSTRAINTS["json_object"]}, False)
    spec = engine.requests[-1][2].structured_output
    assert not accepts(spec, ANALYSIS.removesuffix("<|end|>") + FINAL)


# --- 2. a message to a built-in tool (not functions.*) is reasoning: no call, nothing in the answer ---

BUILTIN = [
    '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query":"weather"}<|call|>',
    ' to=python<|channel|>commentary code<|message|>print(6 * 7)<|call|>',
    '<|channel|>commentary to=container.exec json<|message|>{"cmd":["ls"]}<|call|>',
]


@pytest.mark.parametrize("message", BUILTIN, ids=["browser", "python", "container"])
def test_a_builtin_tool_message_is_reasoning(message):
    body = message.split("<|message|>")[1].removesuffix("<|call|>")
    text = ANALYSIS + "<|start|>assistant" + message
    for chunks in splits(text):
        parser = HarmonyReasoningParser()
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        reasoning, content = "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)
        assert (reasoning, content) == ("Need the weather.\n\n" + body, ""), chunks
        assert not [m for d in deltas for m in d.function_messages], chunks


def test_a_builtin_tool_message_through_chat(harmony_server):
    url, engine = harmony_server
    engine.reply = ANALYSIS + "<|start|>assistant" + BUILTIN[0]
    for stream in (False, True):
        message, reason = chat(url, {"messages": [{"role": "user", "content": "A?"}], "tools": TOOLS}, stream)
        assert message == {"reasoning_content": 'Need the weather.\n\n{"query":"weather"}',
                           "reasoning": 'Need the weather.\n\n{"query":"weather"}'}
        assert reason == "stop"  # no call was made


# --- 3. a function message's body that became text: set apart from its neighbours, in its place ---

def choice_stream(tools) -> ChoiceStream:
    state = SimpleNamespace(tokenizer=None, reasoning_parser_name="harmony", tool_parser_name="harmony")
    return ChoiceStream(state, 0, tools, opens_thinking=False)


def run_choice(chunks, tools) -> tuple[str, list]:
    """The content and calls that ChoiceStream makes of the output arriving in `chunks`."""
    choice, text, content, calls = choice_stream(tools), "", "", []
    for i, chunk in enumerate(chunks):
        text += chunk
        last = i == len(chunks) - 1
        out = SimpleNamespace(text=text, finished=last, finish_reason="stop" if last else None, logprobs=None)
        delta, _ = choice.step(out)
        content += delta.get("content", "")
        calls += [call["function"]["name"] for call in delta.get("tool_calls", ())]
    return content, calls


CALL_BODY = '{"city":"Paris"}'
TEXT_BODY_CASES = [  # output, tools in the request, content
    pytest.param("<|channel|>final<|message|>Here it is:<|end|><|start|>assistant<|channel|>commentary "
                 f"to=functions.get_weather <|constrain|>json<|message|>{CALL_BODY}<|call|>", None,
                 "Here it is:\n\n" + CALL_BODY, id="no-tools-after-an-answer"),
    pytest.param(f"<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{CALL_BODY}<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", TOOLS,
                 CALL_BODY + "\n\nDone.", id="another-function-before-an-answer"),
    pytest.param("<|channel|>commentary<|message|>Let me see.<|end|><|start|>assistant<|channel|>commentary "
                 "to=functions.get_weather json<|message|>not json<|end|><|start|>assistant<|channel|>final"
                 "<|message|>Sunny.<|return|>", TOOLS, "Let me see.\n\nnot json\n\nSunny.", id="between-two"),
]


@pytest.mark.parametrize("text,tools,content", TEXT_BODY_CASES)
def test_a_function_body_that_is_text_is_a_message_of_its_own(text, tools, content):
    for chunks in splits(text):
        assert run_choice(chunks, tools) == (content, []), chunks


def test_a_call_between_messages_keeps_the_answer_joined():
    """A body that became a call adds no separator to the content around it."""
    text = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.get_weather json<|message|>{CALL_BODY}<|end|><|start|>assistant<|channel|>final"
            "<|message|>Sunny.<|return|>")
    for chunks in splits(text):
        assert run_choice(chunks, TOOLS) == ("Checking.\n\nSunny.", ["get_weather"]), chunks


WEATHER_CALL = f"<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{CALL_BODY}<|call|>"
OUTSIDE_CASES = [  # output, content: text outside messages (harmony has none) is content set apart, blanks are none
    pytest.param(ANALYSIS + " " + WEATHER_CALL, "", id="blank-before-a-call"),  # was content " " beside the call
    pytest.param(ANALYSIS + "\n \n" + WEATHER_CALL, "", id="blank-lines-before-a-call"),
    pytest.param("<|channel|>final<|message|>Here.<|end|>" + WEATHER_CALL + " oops", "Here.\n\noops",
                 id="text-after-a-call"),
    pytest.param("<|channel|>final<|message|>Hi<|end|>to", "Hi\n\nto", id="glued-on"),  # was "Hito"
]


@pytest.mark.parametrize("text,content", OUTSIDE_CASES)
def test_text_outside_messages_is_a_message_of_its_own(text, content):
    for chunks in splits(text):
        choice, sent, deltas = choice_stream(TOOLS), "", []
        for i, chunk in enumerate(chunks):
            sent += chunk
            last = i == len(chunks) - 1
            deltas.append(choice.step(SimpleNamespace(text=sent, finished=last, finish_reason="stop" if last else None,
                                                      logprobs=None))[0])
        assert "".join(d.get("content", "") for d in deltas) == content, chunks
        if not content:  # no content at all (null), not an empty or blank one
            assert not any("content" in d for d in deltas), chunks
        calls = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ())]
        assert calls == (["get_weather"] if "get_weather" in text else []), chunks


def test_split_reasoning_keeps_a_function_message_in_its_place():
    out = split_reasoning(HarmonyReasoningParser(), "<|channel|>final<|message|>A<|end|><|start|>assistant"
                          "<|channel|>commentary to=functions.f json<|message|>{}<|end|><|start|>assistant"
                          "<|channel|>final<|message|>B")  # B comes with finish(): after the message
    assert (out.content, [(m.name, m.at) for m in out.function_messages]) == ("A\n\nB", [("f", 1)])


# --- 4. Qwen3-coder: a call the model stopped in before </function> is text ---

QWEN3_OPEN = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"


@pytest.mark.parametrize("text", [QWEN3_OPEN, QWEN3_OPEN + "</func", "Sure.\n" + QWEN3_OPEN + "<parameter=days>\n2"])
def test_qwen3_coder_a_call_stopped_before_its_function_end_is_text(text):
    for chunks in splits(text):
        parser = Qwen3CoderToolParser([WEATHER_TOOL])
        out = parser.feed(chunks[0])
        for chunk in chunks[1:]:
            out += parser.feed(chunk)
        out += parser.finish(truncated=False)
        assert (out.content, out.tool_calls) == (text, []), chunks


def test_qwen3_coder_a_call_cut_by_max_tokens_is_still_a_partial_call():
    [call] = parse_tool_calls(Qwen3CoderToolParser([WEATHER_TOOL]), QWEN3_OPEN, truncated=True).tool_calls
    assert (call.name, json.loads(call.arguments), call.complete) == ("get_weather", {"city": "Oslo"}, False)


# --- 5. strict tools on a template that opened <think>: the reasoning runs free, the calls are held after it ---

@pytest.fixture(scope="module")
def think_server():
    engine = FakeEngine(max_model_len=2048)
    with serve_engine(engine, reasoning_parser="think", tool_call_parser="hermes") as url:
        yield url, engine


STRICT = [{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}]
PLAN = "I could write <tool_call> here, or answer."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_strict_tools_leave_the_opened_reasoning_free(think_server, stream):
    url, engine = think_server
    engine.reply = PLAN + "</think>\n\n" + CALL
    body = {"messages": [{"role": "user", "content": "A?"}], "tools": STRICT, **THINKING}
    message, reason = chat(url, body, stream)
    assert (message["reasoning_content"], reason) == (PLAN, "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"})]
    assert engine.tokenizer.decode(engine.requests[-1][1]).endswith("<think>")  # the block stays open
    spec = engine.requests[-1][2].structured_output
    assert accepts(spec, engine.reply)
    assert accepts(spec, PLAN + "</think>\n\nNo call needed.")
    assert not accepts(spec, PLAN + "</think>\n\n" + CALL.replace("get_weather", "get_time"))  # still held
    assert not accepts(spec, PLAN + "</think>\n\n" + CALL.replace('"Oslo"', "7"))  # to the strict schema


def test_strict_tools_without_an_opened_block_are_held_from_the_start(think_server):
    url, engine = think_server
    engine.reply = CALL
    chat(url, {"messages": [{"role": "user", "content": "A?"}], "tools": STRICT}, False)
    spec = engine.requests[-1][2].structured_output
    assert accepts(spec, CALL)
    assert not accepts(spec, "<tool_call>\n" + PLAN)
