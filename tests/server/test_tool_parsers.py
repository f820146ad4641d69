"""Tool-call and reasoning parsers on fixed strings, fed whole and split at every chunk boundary."""

import json
import random

import pytest

from radiance.server.reasoning_parser import FunctionMessage, ThinkReasoningParser, split_reasoning
from radiance.server.tool_parsers import (Glm45ToolParser, HarmonyToolParser, HermesToolParser, Llama3JsonToolParser,
                                          MistralToolParser, ParseDelta, Qwen3CoderToolParser, parse_tool_calls)

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "extra": {"type": "object"}}}}}


def chunkings(text):
    """Whole, every 2-way split, one char at a time, and a few random splits."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream_tools(parser_cls, chunks, truncated=False):
    parser = parser_cls([WEATHER_TOOL])
    out = ParseDelta()
    for chunk in chunks:
        out += parser.feed(chunk)
    out += parser.finish(truncated)
    return out


def as_tuple(delta):
    return delta.content, [(c.name, c.arguments) for c in delta.tool_calls]


HERMES_CASES = [
    # (text, truncated, expected content, expected [(name, arguments dict or raw str)])
    ("Hello there, no tools here.\n", False, "Hello there, no tools here.\n", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False, "",
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', False, "Let me check.",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', True, "",
     [("get_weather", '{"city": "Pa')]),  # cut off by max_tokens: name and the arguments so far
    # cut before the arguments: the name and no arguments (nothing made up)
    ('<tool_call>\n{"name": "get_weather", "argu', True, "", [("get_weather", "")]),
    # cut inside the end tag: the call is whole, its arguments JSON
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool', True, "",
     [("get_weather", {"city": "Paris"})]),
    ('Sure.<tool_call>{"na', True, "Sure.", []),  # too little to name a function: no call, no markup
    ("Thinking about it <tool_", True, "Thinking about it", []),  # partial start tag at a cut: dropped
    ("a < b and x<tool_ is text", False, "a < b and x<tool_ is text", []),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> done', False, "done",
     [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Köln"}}</tool_call>', False, "",
     [("get_weather", {"city": "Köln"})]),
    # an argument that writes the end tag: inside a JSON string it does not end the call
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call> ok', False, "ok",
     [("get_weather", {"city": "a</tool_call>b"})]),
    # text on both sides of a call stays apart, by the whitespace after the call
    ('Hi <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n\nbye', False, "Hi\n\nbye",
     [("get_weather", {})]),
    # markup that is no call stays text, and the call after it is still read
    ('<tool_call>oops</tool_call> then <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', False,
     "<tool_call>oops</tool_call> then", [("get_weather", {})]),
    # a stray tag in prose, or JSON that broke: text (streamed as it comes, test_text_no_call_can_be_made_of_...)
    ("Use the <tool_call> tag. Then more.", False, "Use the <tool_call> tag. Then more.", []),
    ("<tool_call>{Note} x</tool_call> then", False, "<tool_call>{Note} x</tool_call> then", []),
    ('Hi <tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call> <tool_call>{"name": "get_weather", '
     '"arguments": {}}</tool_call>', False, 'Hi <tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call>',
     [("get_weather", {})]),
    # ... even when max_tokens cuts it: no call (was the markup dropped, or a call of what followed a "name")
    ("Use the <tool_call> tag. Then", True, "Use the <tool_call> tag. Then", []),
    ('<tool_call>{"name": "get_weather", "arguments": {city: 1}} and', True,
     '<tool_call>{"name": "get_weather", "arguments": {city: 1}} and', []),
    # JSON that may still be whole is held: its end tag decides, or the cut reads its partial call
    ('<tool_call>{ "name": "get_weather", "arguments": {"days": 1', True, "", [("get_weather", '{"days": 1')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Ba\\qz"}}</tool_c', True, "",
     [("get_weather", '{"city": "Ba\\qz"}}')]),  # an error inside a string breaks no structure: the cut reads it
    # a whole object with more than whitespace after it is no JSON document: text, cut or not (the cut read it as a
    # partial call whose arguments ran on into what followed the object)
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk', True,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk', []),
    ('Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}}', True,
     'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}}', []),
    ('<tool_call>{"name": "get_weather", "arguments": {}}\n{"name": "get_weather", "arguments": {"ci', True,
     '<tool_call>{"name": "get_weather", "arguments": {}}\n{"name": "get_weather", "arguments": {"ci', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} </tool_callx', True,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} </tool_callx', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk', False,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk</tool_call> ok', False,
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} junk</tool_call> ok', []),
    # ... but a whole object with only whitespace after it, then cut, is a whole call (a partial end tag too)
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} \n ', True, "",
     [("get_weather", {"city": "Paris"})]),
    ('Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_ca', True, "Hi",
     [("get_weather", {"city": "Paris"})]),
]


def check(result, content, calls):
    got_content, got_calls = as_tuple(result)
    assert got_content == content
    assert [c[0] for c in got_calls] == [c[0] for c in calls]
    for (_, got_args), (_, want_args) in zip(got_calls, calls):
        if isinstance(want_args, dict):
            assert json.loads(got_args) == want_args
        else:
            assert got_args == want_args
    if "tool_call>" not in content:  # markup reaches content only where the case says it is text
        assert "<tool_call>" not in got_content and "</tool_call>" not in got_content


QWEN3_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
              "<parameter=extra>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>")

QWEN3_CASES = [
    (QWEN3_CALL, False, "", [("get_weather", {"city": "New York", "days": 3, "metric": True, "extra": {"a": [1, 2]}})]),
    ("I will look it up.\n\n" + QWEN3_CALL + "\n", False, "I will look it up.",
     [("get_weather", {"city": "New York", "days": 3, "metric": True, "extra": {"a": [1, 2]}})]),
    # cut inside the second parameter's value: whole parameters only, still valid JSON
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n<parameter=days>\n1", True, "",
     [("get_weather", {"city": "Lyon"})]),
    ("<tool_call>\n<function=get_wea", True, "", []),
    # a model that forgets </parameter>
    ("<tool_call><function=get_weather><parameter=city>Bern<parameter=days>4</function></tool_call>", False, "",
     [("get_weather", {"city": "Bern", "days": 4})]),
    ("No call, but a literal <tool> tag.", False, "No call, but a literal <tool> tag.", []),
    # a parameter value that writes the end tag: the call goes on to its </function>, whole
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nx = '</tool_call>'\n</parameter>\n</function>\n"
     "</tool_call> ok", False, "ok", [("get_weather", {"city": "x = '</tool_call>'"})]),
    # a value that writes </parameter> itself: the value ends at the </parameter> the next markup follows
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nx = '</parameter>'\nprint(x)\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", False, "",
     [("get_weather", {"city": "x = '</parameter>'\nprint(x)", "days": 3})]),
    # no </function> before </tool_call>: the model wrote no whole call, so it is text (was a complete, empty call)
    ("<tool_call>\n<function=get_weather>\nKöln</tool_call>", False,
     "<tool_call>\n<function=get_weather>\nKöln</tool_call>", []),
]


# GLM-4.5's template: the name on the call's first line, then key / value pairs; non-string values written as JSON
GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n"
            "<arg_value>true</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n"
            "</tool_call>")
GLM_ARGS = {"city": "New York", "days": 3, "metric": True, "extra": {"a": [1, 2]}}

GLM_CASES = [
    (GLM_CALL, False, "", [("get_weather", GLM_ARGS)]),
    ("<think>no</think>\nLet me check.\n" + GLM_CALL + "\n" + GLM_CALL.replace("New York", "Rome"), False,
     "<think>no</think>\nLet me check.", [("get_weather", GLM_ARGS), ("get_weather", dict(GLM_ARGS, city="Rome"))]),
    # cut inside the second value: whole arguments only
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>1", True, "", [("get_weather", {"city": "Lyon"})]),
    # a call without arguments
    ("<tool_call>get_weather\n</tool_call>", False, "", [("get_weather", {})]),
    # GLM-4.7's template writes no newlines between the parts
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>", False, "",
     [("get_weather", {"city": "Oslo"})]),
    # a value that writes the end tag: the call goes on to the </tool_call> after its closed value
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>x = '</tool_call>'</arg_value>\n</tool_call> ok",
     False, "ok", [("get_weather", {"city": "x = '</tool_call>'"})]),
    # a tool the request does not offer: text
    ("<tool_call>get_time\n</tool_call>", False, "<tool_call>get_time\n</tool_call>", []),
    # the model stopped (no end tag) after a closed value: whole; inside a value: text
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>", False, "",
     [("get_weather", {"city": "Oslo"})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Os", False,
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Os", []),
]


# the markups whose calls sit between <tool_call> and </tool_call>: each parser's cases
TAGGED_PARSERS = ((HermesToolParser, HERMES_CASES), (Qwen3CoderToolParser, QWEN3_CASES), (Glm45ToolParser, GLM_CASES))
TAGGED_CASES = [(parser, *case) for parser, cases in TAGGED_PARSERS for case in cases]


@pytest.mark.parametrize("parser_cls,text,truncated,content,calls", TAGGED_CASES,
                         ids=[f"{c[0].name}-{i}" for i, c in enumerate(TAGGED_CASES)])
def test_tagged_calls_same_result_at_every_chunk_boundary(parser_cls, text, truncated, content, calls):
    whole = parse_tool_calls(parser_cls([WEATHER_TOOL]), text, truncated)
    check(whole, content, calls)
    for chunks in chunkings(text):
        assert as_tuple(stream_tools(parser_cls, chunks, truncated)) == as_tuple(whole), chunks


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
LLAMA3_CASES = [
    (LLAMA_CALL, False, "", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("<|python_tag|>" + LLAMA_CALL, False, "", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("\n " + LLAMA_CALL + "; " + LLAMA_CALL.replace("Oslo", "Rome"), False, "",
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]),
    # text first: no call (Llama writes calls as the whole answer), braces and all
    ('It is sunny. {"name": "get_weather"}', False, 'It is sunny. {"name": "get_weather"}', []),
    # a JSON answer that is no call stays content, as does text after the calls
    ('{"city": "Oslo"}', False, '{"city": "Oslo"}', []),
    # separators as a run of any length, however it is chunked
    (LLAMA_CALL + "; ;\n" + LLAMA_CALL + "; ; ", False, "",
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Oslo", "days": 2})]),
    (LLAMA_CALL + " Done. It is sunny.", False, "Done. It is sunny.", [("get_weather", {"city": "Oslo", "days": 2})]),
    # cut off by max_tokens: the name and the arguments so far
    ('{"name": "get_weather", "parameters": {"city": "Os', True, "", [("get_weather", '{"city": "Os')]),
    # a JSON object that is no call, then text: content as written, spacing kept
    ('{"a": 1}\n\nThat is JSON.', False, '{"a": 1}\n\nThat is JSON.', []),
    # braces that are no JSON: text (released as soon as the syntax breaks, not held to the end)
    ("{x} is a set, {y} another.", False, "{x} is a set, {y} another.", []),
    ("", False, "", []),
]


@pytest.mark.parametrize("text,truncated,content,calls", LLAMA3_CASES)
def test_llama3_json_same_result_at_every_chunk_boundary(text, truncated, content, calls):
    whole = parse_tool_calls(Llama3JsonToolParser([WEATHER_TOOL]), text, truncated)
    check(whole, content, calls)
    for chunks in chunkings(text) if text else [[""]]:
        assert as_tuple(stream_tools(Llama3JsonToolParser, chunks, truncated)) == as_tuple(whole), chunks


def test_llama3_json_releases_text_that_cannot_become_json_at_once():
    """An answer that opens with '{' but breaks JSON syntax streams as it comes (it was held to the end)."""
    parser = Llama3JsonToolParser([WEATHER_TOOL])
    assert parser.feed("{x") == ParseDelta(content="{x")
    assert parser.feed("} is a set.") == ParseDelta(content="} is a set.")
    for unfinished in ('{"name": "get_weather", "parameters": {"city": "Os', '{"name": "get_weather", "parameters": '
                       '{"days": -', '{"name": "get_weather", "parameters": {"days": 1.', '{"name": "get_weather", '
                       '"parameters": {"metric": tr', '{"name": "get_weather", "parameters": {"extra": nu'):
        assert Llama3JsonToolParser([WEATHER_TOOL]).feed(unfinished) == ParseDelta(), unfinished  # may be a call


NOT_CALLS_THEN_PROSE = [  # (parser, markup that no further text can make a call), "word " * 200 after each
    (Llama3JsonToolParser, "{Note} "),
    (HermesToolParser, "Use the <tool_call> tag. "),
    (HermesToolParser, "<tool_call>{Note} "),
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {city: 1}} '),
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} and '),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {city: 1}}] '),
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]{city: 1} "),
]


@pytest.mark.parametrize("parser_cls,opening", NOT_CALLS_THEN_PROSE)
def test_text_no_call_can_be_made_of_streams_as_it_comes(parser_cls, opening):
    """Markup whose JSON broke (or a stray tag in prose) is text whatever follows: streamed token by token it goes
    out soon after it breaks, not all at finish() (the prose after it came in one final chunk); same result."""
    text = opening + "word " * 200
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]  # about a token each
    parser, sent = parser_cls([WEATHER_TOOL]), []
    for piece in pieces:
        sent.append(parser.feed(piece).content)
    last = parser.finish().content
    assert "".join(sent) + last == text == parse_tool_calls(parser_cls([WEATHER_TOOL]), text).content
    assert len(last) <= 5  # at most a held trailing space
    # out by the time as much text follows the break as came before it (a call's body is looked at again only
    # once it has doubled), then on as it comes
    out_by = 2 * len(opening) + 8
    assert all(len("".join(sent[:i])) >= 4 * i - 8 for i in range(out_by // 4, len(sent) + 1))


# prefixes of these are JSON that may still be whole: never taken for broken (every feature a call's JSON may use)
VALID_CALL_BODIES = [
    '\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich \\ud83d\\ude00 \\"q\\" \\\\ \\/ \\n", '
    '"days": -12.5e+3, "n": 0, "f": 1E-2, "metric": true, "x": false, "extra": {"a": [1, 2.0, null, [], {}], "b": '
    '"}{][,:"}}}\n',
    '{ "name" : "get_weather" , "arguments" : { } }',
    '{"name":"get_weather","parameters":{"days":[ -0.0 , 1 ],"s":"</tool_call>"}}',
]


@pytest.mark.parametrize("body", VALID_CALL_BODIES)
def test_json_that_may_still_be_whole_is_never_taken_for_broken(body):
    from radiance.server.tool_parsers.json_calls import _broken_json, _broken_structure
    hermes = HermesToolParser([WEATHER_TOOL])
    for end in range(len(body) + 1):
        prefix = body[:end]
        assert not hermes.body_broken(prefix), prefix
        start = len(prefix) - len(prefix.lstrip())
        if prefix.strip():
            try:
                json.JSONDecoder().raw_decode(prefix, start)
            except ValueError as exc:
                assert not _broken_structure(exc, prefix) and not _broken_json(exc, prefix), prefix


@pytest.mark.parametrize("body", ["{Note} x", ' tag. {"name": 1}', '{"name": "get_weather" "arguments": {}}',
                                  '{"name": "get_weather", "arguments": {city: 1}}', '{"a": 1,}', "{ x}", "\xa0{}",
                                  '{"name": "get_weather", "arguments": {}} x', '{"name": "get_weather"}}'])
def test_json_that_broke_stays_broken_whatever_follows(body):
    """Once broken, always: so a body released as text early is text at its end tag, stop or cut too."""
    hermes = HermesToolParser([WEATHER_TOOL])
    broken = [hermes.body_broken(body[:end]) for end in range(len(body) + 1)]
    assert broken[-1] and broken == sorted(broken), broken


def test_hermes_looks_at_a_long_call_body_a_logarithmic_number_of_times():
    """Telling broken JSON decodes the body: again only once it has doubled, so a long call streamed piece by piece
    costs linear time (decoding it on every piece, or at every '}' its code writes, was quadratic)."""
    parser = HermesToolParser([WEATHER_TOOL])
    decodes = []
    raw_decode = parser._decoder.raw_decode
    parser._decoder.raw_decode = lambda text, *a: decodes.append(len(text)) or raw_decode(text, *a)
    value = "x = {}; " * 5000
    out = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "')
    for i in range(0, len(value), 4):
        out += parser.feed(value[i:i + 4])
    out += parser.feed('"}}</tool_call>')
    out += parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": value})]
    assert sum(decodes) < 3 * len(value) and len(decodes) < 20


def test_llama3_json_emits_a_call_as_soon_as_it_closes():
    parser = Llama3JsonToolParser([WEATHER_TOOL])
    assert parser.feed(LLAMA_CALL[:-1]).tool_calls == []
    [call] = parser.feed("}; ").tool_calls
    assert call.name == "get_weather" and parser.feed('{"name": "get_').tool_calls == []
    rest = parser.finish()  # no whole name: nothing to call, the text is kept
    assert rest.tool_calls == [] and rest.content == '{"name": "get_'


REASONING_CASES = [
    # (text, starts_inside, reasoning, content)
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, "The user greets.\n", "Hello!"),
    ("  <think>short</think>answer", False, "short", "answer"),
    ("Plain answer, no thinking.", False, "", "Plain answer, no thinking."),
    ("\nI reason in the prompt's block.\n</think>\n\nDone.", True, "I reason in the prompt's block.\n", "Done."),
    ("<think>cut off while thin", False, "cut off while thin", ""),
    ("<thi", False, "", "<thi"),
    ("a <think> in the middle stays content", False, "", "a <think> in the middle stays content"),
]


@pytest.mark.parametrize("text,starts_inside,reasoning,content", REASONING_CASES)
def test_reasoning_same_result_at_every_chunk_boundary(text, starts_inside, reasoning, content):
    whole = split_reasoning(ThinkReasoningParser(starts_inside), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for chunks in chunkings(text):
        parser = ThinkReasoningParser(starts_inside)
        got_r, got_c = "", ""
        for chunk in chunks:
            d = parser.feed(chunk)
            got_r, got_c = got_r + d.reasoning, got_c + d.content
        d = parser.finish()
        assert (got_r + d.reasoning, got_c + d.content) == (reasoning, content), chunks


def test_reasoning_then_tool_call_streams_like_the_whole():
    text = "<think>need weather</think>\n" + QWEN3_CALL
    for chunks in chunkings(text):
        rp, tp = ThinkReasoningParser(), Qwen3CoderToolParser([WEATHER_TOOL])
        reasoning, tools = "", ParseDelta()
        for chunk in chunks:
            d = rp.feed(chunk)
            reasoning += d.reasoning
            tools += tp.feed(d.content)
        d = rp.finish()
        reasoning += d.reasoning
        tools += tp.feed(d.content)
        tools += tp.finish()
        assert reasoning == "need weather"
        assert tools.content == ""
        assert [c.name for c in tools.tool_calls] == ["get_weather"]


def test_hermes_invalid_escape_in_a_cut_off_call_keeps_the_raw_name():
    text = '<tool_call>{"name": "get\\qweather", "arguments": {"city": "Par'
    odd_tool = {"type": "function", "function": {"name": "get\\qweather"}}  # a call must name an offered tool
    whole = parse_tool_calls(HermesToolParser([odd_tool]), text, truncated=True)
    assert [c.name for c in whole.tool_calls] == ["get\\qweather"]
    assert "<tool_call>" not in whole.content


def test_calls_say_whether_max_tokens_cut_their_arguments():
    """A call cut off by max_tokens before its arguments were whole is marked incomplete (the Responses API's
    function_call item then says so); a call whose end tag alone was cut is complete."""
    cut = parse_tool_calls(HermesToolParser([WEATHER_TOOL]), '<tool_call>{"name": "get_weather", "arguments": {"ci',
                           truncated=True)
    assert [c.complete for c in cut.tool_calls] == [False]
    whole = parse_tool_calls(HermesToolParser([WEATHER_TOOL]),
                             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_c', truncated=True)
    assert [c.complete for c in whole.tool_calls] == [True]
    llama = parse_tool_calls(Llama3JsonToolParser([WEATHER_TOOL]), '{"name": "get_weather", "parameters": {"ci',
                             truncated=True)
    assert [(c.arguments, c.complete) for c in llama.tool_calls] == [('{"ci', False)]


def test_the_parser_options_name_every_registered_parser_and_no_other():
    """--tool-call-parser / --reasoning-parser choices (config) and the parser registries are written apart."""
    from radiance.config import REASONING_PARSERS, TOOL_CALL_PARSERS
    from radiance.server import reasoning_parser, tool_parsers

    assert set(TOOL_CALL_PARSERS) == set(tool_parsers.PARSERS) | {"auto", "none"}
    assert set(REASONING_PARSERS) == set(reasoning_parser.PARSERS) | {"auto", "none"}



def test_auto_picks_from_every_registered_parser_by_a_known_template_feature():
    """The "auto" order (server.state) is a third list of the same names: each names a registered parser and a
    feature template_features reports, and every registered parser can be picked."""
    from radiance.server import reasoning_parser, tool_parsers
    from radiance.server.chat_template import template_features
    from radiance.server.state import AUTO_REASONING_PARSERS, AUTO_TOOL_PARSERS, auto_parsers

    features = set(template_features(""))
    for order, registry in ((AUTO_REASONING_PARSERS, reasoning_parser.PARSERS), (AUTO_TOOL_PARSERS, tool_parsers.PARSERS)):
        assert {parser for parser, _ in order} == set(registry)
        assert {feature for _, feature in order} <= features
    assert auto_parsers("{{ messages }}") == (None, None)
    assert auto_parsers("<think>{{ m }}</think><tool_call>{{ t }}</tool_call>") == ("think", "hermes")
    # GLM-4.5's template writes <tool_call> too, with its key / value markup: not Hermes JSON
    assert auto_parsers("<think></think><tool_call>{{ n }}<arg_key>{{ k }}</arg_key></tool_call>") == ("think", "glm45")


@pytest.mark.parametrize("parser_cls,opening", [
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "'),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "'),
])
def test_a_long_call_streamed_piece_by_piece_is_not_decoded_again_on_every_piece(parser_cls, opening):
    """A JSON object only closes with a '}': pieces without one are not decoded from the call's start again
    (a 175k-character call in 4-character pieces took 5 s of the event loop)."""
    parser = parser_cls([WEATHER_TOOL])
    decodes = []
    raw_decode = parser._decoder.raw_decode
    parser._decoder.raw_decode = lambda text, *a: decodes.append(len(text)) or raw_decode(text, *a)
    value = "x" * 40_000
    out = parser.feed(opening)
    for i in range(0, len(value), 4):
        out += parser.feed(value[i:i + 4])
    out += parser.feed('"}}' + ("]" if opening.startswith("[") else ""))
    out += parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": value})]
    # short buffers are still decoded on every piece (llama3_json tells broken JSON at once there); past that,
    # only at a '}'. It was every piece: ~10_000 pieces x 20_000 characters on average
    assert sum(decodes) < 4096 * 4096 // 4 + 3 * len(value)


def some_chunkings(text):
    """Whole, one char at a time, and a few random splits (a long text's every 2-way split is too many)."""
    yield [text]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# a call's arguments nested deeper than json reads: the decoder raised RecursionError, which escaped mid-stream
DEEP = "[" * 3000
DEEP_BODIES = [  # (parser, opening, closing of a whole call)
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"extra": ', "}}</tool_call>"),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"extra": ', "}"),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"extra": ', "}}]"),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"extra": ', "}}"),
]


@pytest.mark.parametrize("parser_cls,opening,closing", DEEP_BODIES)
def test_arguments_nested_too_deep_to_read_are_text(parser_cls, opening, closing):
    """No call can be read from them: the model's text, whole or streamed, stopped or cut, never an exception."""
    for text in (opening + DEEP, opening + DEEP + "]" * len(DEEP) + closing, opening + DEEP + " and so on"):
        for truncated in (False, True):
            for chunks in some_chunkings(text):
                assert as_tuple(stream_tools(parser_cls, chunks, truncated)) == (text, []), (truncated, len(chunks))


def test_arguments_too_deep_for_json_are_no_call():
    """Arguments written as a string too deep to read, or read a few frames up and too deep for json to write
    again: no call, the text is content (each was a RecursionError); a typed qwen3_coder value stays a string."""
    from radiance.server.tool_parsers.base import _object_text
    arguments: dict = {}
    for _ in range(5000):
        arguments = {"a": arguments}
    assert _object_text(arguments) is None
    deep = "[" * 5000 + "]" * 5000
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"extra\\": ' + deep + '}"}</tool_call>'
    for chunks in some_chunkings(text):
        assert as_tuple(stream_tools(HermesToolParser, chunks)) == (text, [])
    message = FunctionMessage("get_weather", '{"extra": ' + deep + "}")
    assert HarmonyToolParser([WEATHER_TOOL]).function_message(message) == ParseDelta(content=message.arguments)
    parsed = parse_tool_calls(Qwen3CoderToolParser([WEATHER_TOOL]), "<tool_call><function=get_weather><parameter="
                              f"extra>{deep}</parameter></function></tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"extra": deep})]


def test_llama3_json_long_call_that_broke_is_text_however_it_was_chunked():
    """Past a few KB the answer is decoded only at a '}': a break no '}' followed was seen by finish() alone, which
    made a cut call of it when it came whole but text when it came token by token. Text both ways."""
    text = '{"name": "get_weather", "parameters": {"city": "x" Note: ' + "y" * 5000
    for truncated in (False, True):
        for chunks in some_chunkings(text):
            assert as_tuple(stream_tools(Llama3JsonToolParser, chunks, truncated)) == (text, []), len(chunks)
