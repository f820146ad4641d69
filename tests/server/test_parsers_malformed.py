"""Model output that is no usable tool call (broken JSON, a name the request did not offer, arguments that are
no object, a call left open when the model stopped) is the model's text: it comes back as content, markup and
all, as vLLM returns it, never as a call clients cannot run nor as lost text. Only a cut by max_tokens keeps
its partial call (or drops its markup), unless its JSON had already broken (then it is text, streamed as it came).
Also: a `<think>` the model writes again after the prompt opened one."""

import json

import openai
import pytest

from radiance.server.reasoning_parser import ThinkReasoningParser, split_reasoning
from radiance.server.tool_parsers import (HermesToolParser, Llama3JsonToolParser, ParseDelta,
                                          Qwen3CoderToolParser, parse_tool_calls)
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.test_tool_parsers import WEATHER_TOOL, chunkings, stream_tools


def calls_of(delta: ParseDelta) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in delta.tool_calls]


def same_in_every_chunking(parser_cls, text, truncated=False) -> ParseDelta:
    whole = parse_tool_calls(parser_cls([WEATHER_TOOL]), text, truncated)
    for chunks in chunkings(text):
        streamed = stream_tools(parser_cls, chunks, truncated)
        assert (streamed.content, calls_of(streamed)) == (whole.content, calls_of(whole)), chunks
    return whole


HERMES_NOT_CALLS = [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',  # a brace short
    '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not among the request's tools
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "sunny"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": 3}</tool_call>',
    "<tool_call>[1]</tool_call>",
    "Use the <tool_call> tag to call a tool.",  # opened, never closed, the model stopped: text
    '<tool_call>{"name": "get_weather", "arguments": {"city": ',  # stopped (not cut) inside the JSON
]


@pytest.mark.parametrize("text", HERMES_NOT_CALLS)
def test_hermes_text_that_is_no_call_is_content(text):
    whole = same_in_every_chunking(HermesToolParser, text)
    assert (whole.content, whole.tool_calls) == (text, [])


def test_hermes_a_broken_call_between_text_keeps_the_text_and_its_spaces():
    text = 'Hi <tool_call>oops</tool_call> bye <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    whole = same_in_every_chunking(HermesToolParser, text)
    assert whole.content == "Hi <tool_call>oops</tool_call> bye"
    assert calls_of(whole) == [("get_weather", "{}")]


def test_hermes_good_call_then_broken_call():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>')
    whole = same_in_every_chunking(HermesToolParser, text)
    assert calls_of(whole) == [("get_weather", '{"city": "Rome"}')]
    assert whole.content == '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'


@pytest.mark.parametrize("arguments", ["null", None])
def test_hermes_null_or_missing_arguments_are_an_empty_object(arguments):
    extra = "" if arguments is None else f', "arguments": {arguments}'
    whole = same_in_every_chunking(HermesToolParser, '<tool_call>{"name": "get_weather"' + extra + "}</tool_call>")
    assert calls_of(whole) == [("get_weather", "{}")]


def test_hermes_a_call_whose_end_tag_never_came_is_a_call_when_its_json_is_whole():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    whole = same_in_every_chunking(HermesToolParser, text)
    assert calls_of(whole) == [("get_weather", '{"city": "Oslo"}')] and whole.tool_calls[0].complete


def test_hermes_cut_by_max_tokens_still_gives_the_partial_call():
    whole = same_in_every_chunking(HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"ci', True)
    assert calls_of(whole) == [("get_weather", '{"ci')] and not whole.tool_calls[0].complete


@pytest.mark.parametrize("after", [" junk", "}", ' {"name": "get_weather", "arguments": {}}', "\n</tool_callx"])
@pytest.mark.parametrize("truncated", [True, False])
def test_hermes_a_whole_object_then_more_than_whitespace_is_text_cut_or_not(after, truncated):
    """A cut output whose markup broke is text: a whole object with junk after it (the output ending there, no
    end tag) is no call, whether max_tokens cut it or the model stopped (a cut read it as a partial call of
    arguments `{"city": "Oslo"}} junk`)."""
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' + after
    whole = same_in_every_chunking(HermesToolParser, text, truncated)
    assert (whole.content, whole.tool_calls) == (text, [])


@pytest.mark.parametrize("after", ["", " ", "\n\t ", "\n</tool_", "\n</tool_call"])
def test_hermes_a_whole_object_then_only_whitespace_cut_is_a_whole_call(after):
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' + after
    whole = same_in_every_chunking(HermesToolParser, text, truncated=True)
    assert whole.content == "Hi"
    assert calls_of(whole) == [("get_weather", '{"city": "Oslo"}')] and whole.tool_calls[0].complete


QWEN3_NOT_CALLS = [
    "<tool_call>garbage</tool_call>",
    "<tool_call>\n<function=delete_all>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "I write <tool_call> when I call.",
]


@pytest.mark.parametrize("text", QWEN3_NOT_CALLS)
def test_qwen3_coder_text_that_is_no_call_is_content(text):
    whole = same_in_every_chunking(Qwen3CoderToolParser, text)
    assert (whole.content, whole.tool_calls) == (text, [])


def test_qwen3_coder_a_whole_function_without_its_end_tag_is_a_complete_call():
    """The model stopped after </function> (no </tool_call>): the call is whole, not cut."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
    for truncated in (False, True):
        whole = same_in_every_chunking(Qwen3CoderToolParser, text, truncated)
        assert calls_of(whole) == [("get_weather", '{"city": "Oslo"}')]
        assert whole.tool_calls[0].complete


LLAMA3_NOT_CALLS = [
    '{"name": "delete_all", "parameters": {}}',
    '{"name": "get_weather", "parameters": {"city": }}',
    '{"name": "get_weather", "parameters": [1]}',
    '{"name": "get_weather", "parameters": {"city": "Os',  # stopped, not cut
]


@pytest.mark.parametrize("text", LLAMA3_NOT_CALLS)
def test_llama3_json_text_that_is_no_call_is_content(text):
    whole = same_in_every_chunking(Llama3JsonToolParser, text)
    assert (whole.content, whole.tool_calls) == (text, [])


def test_llama3_json_an_unknown_call_after_a_good_one_is_content():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "nope", "parameters": {}}'
    whole = same_in_every_chunking(Llama3JsonToolParser, text)
    assert calls_of(whole) == [("get_weather", '{"city": "Oslo"}')]
    assert whole.content == '{"name": "nope", "parameters": {}}'


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>\nI reason.\n</think>\n\nDone.", "I reason.\n", "Done."),  # the model opens the block again
    ("  <think>I reason.</think>Done.", "I reason.", "Done."),
    ("<thi", "<thi", ""),  # cut after a partial tag: reasoning, as all text before </think>
    ("<b>I reason.</b></think>Done.", "<b>I reason.</b>", "Done."),
])
def test_think_drops_a_repeated_opening_tag(text, reasoning, content):
    """Qwen3 / DeepSeek-R1 templates end the prompt with <think>; a model that writes <think> again is still
    reasoning, without the tag (as vLLM strips it)."""
    for chunks in chunkings(text):
        parser, got_r, got_c = ThinkReasoningParser(starts_inside=True), "", ""
        for chunk in chunks + [None]:
            delta = parser.feed(chunk) if chunk is not None else parser.finish()
            got_r, got_c = got_r + delta.reasoning, got_c + delta.content
        assert (got_r, got_c) == (reasoning, content), chunks
    whole = split_reasoning(ThinkReasoningParser(starts_inside=True), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)


TOOLS = [WEATHER_TOOL]


@pytest.fixture(scope="module")
def client():
    with serve_engine(FakeEngine(max_model_len=2048)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def chat(client, say, **kw):
    return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "SAY:" + say}],
                                          tools=TOOLS, **kw)


@pytest.mark.parametrize("say", ['<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
                                 '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'])
def test_server_returns_a_call_that_does_not_parse_as_content_with_finish_reason_stop(client, say):
    whole = chat(client, say).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (say, None, "stop")
    chunks = list(chat(client, say, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == say
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_server_streams_calls_with_indexes_ids_and_whole_arguments(client):
    say = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    chunks = list(chat(client, say, stream=True))
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    by_index: dict[int, list] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == [0, 1]
    for index, city in ((0, "Paris"), (1, "Rome")):
        parts = by_index[index]
        assert len({p.id for p in parts if p.id}) == 1  # one id per call
        assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": city}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    whole = chat(client, say).choices[0]
    assert [json.loads(t.function.arguments) for t in whole.message.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"


NUMBER_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}, "y": {"type": "object"}}}}}


def strict_json(text):
    """JSON as a client reads it: NaN and Infinity are no JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}"))


@pytest.mark.parametrize("parser_cls,text", [
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": Infinity}"}</tool_call>'),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": -Infinity}}'),
])
def test_json_calls_with_nan_or_infinity_are_content(parser_cls, text):
    """Python's json reads NaN / Infinity; a client's JSON.parse does not: such arguments are no call."""
    whole = parse_tool_calls(parser_cls([NUMBER_TOOL]), text)
    assert (whole.content, whole.tool_calls) == (text, [])


def test_qwen3_coder_non_finite_numbers_stay_text():
    text = ('<tool_call><function=f><parameter=x>inf</parameter><parameter=y>{"a": NaN}</parameter></function>'
            '</tool_call>')
    [call] = parse_tool_calls(Qwen3CoderToolParser([NUMBER_TOOL]), text).tool_calls
    assert strict_json(call.arguments) == {"x": "inf", "y": '{"a": NaN}'}
