"""Mistral tool calls: the parser (both shapes, at every chunk boundary, cut by max_tokens), the grammars that hold
forced and strict calls in each template's markup, the 9-character call ids Mistral's templates insist on, and the
server end to end on a scripted engine whose tokenizer has [TOOL_CALLS] as a special token."""

import json
import random

import openai
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from radiance.engine.tool_grammars import MISTRAL, MISTRAL_ARGS, MISTRAL_CALL_ID, MISTRAL_COMPACT, call_markup, \
    strict_tools_grammar, tool_call_grammar
from radiance.server.chat_template import TemplateError, mistral_call_id, render_chat
from radiance.server.reasoning_parser import ThinkReasoningParser
from radiance.server.tool_parsers import MistralToolParser
from tests.server.fake_engine import FakeEngine, calls_content_reason, serve_engine
from tests.server.test_parsers_property import random_chunks, run_chain
from tests.server.test_tool_parsers import WEATHER_TOOL, as_tuple, chunkings, stream_tools

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'

CASES = [
    # (output, truncated, content, [(name, arguments dict, or the raw text of a call cut short)])
    ("No tools needed.", False, "No tools needed.", []),
    (f"[TOOL_CALLS] [{OSLO}]", False, "", [("get_weather", {"city": "Oslo"})]),  # v0.3's spacing
    (f"[TOOL_CALLS][{OSLO}]", False, "", [("get_weather", {"city": "Oslo"})]),  # Nemo's
    # text before and after, a second call, an "id" the model added
    ('Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, '
     '{"name": "get_weather", "arguments": {"city": "Bern", "days": 2}}] Done.', False, "Let me look. Done.",
     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bern", "days": 2})]),
    # v11: a marker per call, [CALL_ID] in some templates, [ARGS] dropped by a detokenizer that skipped it
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[CALL_ID]x1y2z3w4v[ARGS]{"city": "Bern"}',
     False, "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bern"})]),
    ('[TOOL_CALLS]get_weather{"city": "Köln"}', False, "", [("get_weather", {"city": "Köln"})]),
    ('[TOOL_CALLS]get_weather[ARGS]"{\\"city\\": \\"Oslo\\"}"', False, '[TOOL_CALLS]get_weather[ARGS]"{\\"city\\": '
     '\\"Oslo\\"}"', []),  # arguments that are no object: text
    # no usable call: the model's text, markup and all
    ("[TOOL_CALLS] not a call", False, "[TOOL_CALLS] not a call", []),
    ('[TOOL_CALLS] [{"name": "rm", "arguments": {}}]', False, '[TOOL_CALLS] [{"name": "rm", "arguments": {}}]', []),
    ("[TOOL_CALLS] []", False, "[TOOL_CALLS] []", []),
    ('[TOOL_CALLS]rm[ARGS]{"path": "/"}', False, '[TOOL_CALLS]rm[ARGS]{"path": "/"}', []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Os', False,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Os', []),  # stopped mid-call
    # an array the model stopped in after whole calls: the calls stand
    (f"[TOOL_CALLS] [{OSLO}", False, "", [("get_weather", {"city": "Oslo"})]),
    # cut by max_tokens: the name and the arguments so far, no markup as content
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Os', True, "", [("get_weather", '{"city": "Os')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Os', True, "", [("get_weather", '{"city": "Os')]),
    ("Checking [TOOL_CA", True, "Checking", []),
    ("[TOOL_CALLS]get_wea", True, "", []),
    ("see [1] and [TOOL] [2]", False, "see [1] and [TOOL] [2]", []),
    # an array mixing calls and objects that are no call: each such object is content alone, without the array's
    # separators or markup (was "Sure , {...}" and "[TOOL_CALLS][{...} done"), wherever it stands
    (f'Sure [TOOL_CALLS][{OSLO}, {{"name": "nope", "arguments": {{}}}}]', False,
     'Sure {"name": "nope", "arguments": {}}', [("get_weather", {"city": "Oslo"})]),
    (f'[TOOL_CALLS][{{"name": "nope", "arguments": {{}}}}, {OSLO}] done', False,
     '{"name": "nope", "arguments": {}} done', [("get_weather", {"city": "Oslo"})]),
    (f'A [TOOL_CALLS][{OSLO}, {{"name": "nope", "arguments": {{}}}}, {OSLO}] B', False,
     'A {"name": "nope", "arguments": {}} B', [("get_weather", {"city": "Oslo"})] * 2),
    ('[TOOL_CALLS] [{"name": "nope", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Os', True,
     '{"name": "nope", "arguments": {}}', [("get_weather", '{"city": "Os')]),
    # JSON that breaks before its end: text, and so is the rest of the output, markers and all (streamed as soon as
    # it breaks: test_tool_parsers.test_text_no_call_can_be_made_of_streams_as_it_comes)
    ('See [TOOL_CALLS][{"name": "get_weather", "arguments": {city: 1}}] then [TOOL_CALLS][' + OSLO + "]", False,
     'See [TOOL_CALLS][{"name": "get_weather", "arguments": {city: 1}}] then [TOOL_CALLS][' + OSLO + "]", []),
    ("[TOOL_CALLS]get_weather[ARGS]{city: 1} done", False, "[TOOL_CALLS]get_weather[ARGS]{city: 1} done", []),
    # ... cut by max_tokens too (was a call of get_weather with '{city: 1}}] and' for arguments)
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {city: 1}}] and', True,
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {city: 1}}] and', []),
    ('Hi [TOOL_CALLS] [{Note', True, 'Hi [TOOL_CALLS] [{Note', []),  # was "Hi", the rest dropped as markup
]


def check(result, content, calls):
    got_content, got_calls = as_tuple(result)
    assert got_content == content
    assert [name for name, _ in got_calls] == [name for name, _ in calls]
    for (_, got), (_, want) in zip(got_calls, calls):
        assert (json.loads(got) if isinstance(want, dict) else got) == want


@pytest.mark.parametrize("text,truncated,content,calls", CASES)
def test_mistral_calls_at_every_chunk_boundary(text, truncated, content, calls):
    for chunks in chunkings(text):
        check(stream_tools(MistralToolParser, chunks, truncated), content, calls)


def test_mistral_any_chunking_agrees():
    """Random outputs of text, calls in both shapes and broken markup: the same content and calls however the
    output is chunked, every call to an offered tool with an object for arguments."""
    pieces = ["Sure. ", f"[TOOL_CALLS] [{OSLO}]", f'[TOOL_CALLS][{OSLO}, {{"name": "get_time", "arguments": {{}}}}]',
              '[TOOL_CALLS]get_weather[ARGS]{"city": "Rom"}', "[TOOL_CALLS] oops ", '[TOOL_CALLS] [{"x": 1}]',
              "日本 🙂", " [1] ", "[TOOL_CALLS]rm[ARGS]{}", "{", "]",
              '[TOOL_CALLS] [{"name": "get_weather", {city: 1}}]', "[TOOL_CALLS]get_weather[ARGS]{Note} "]
    rng = random.Random(11)
    for _ in range(200):
        output = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))
        for truncated in (False, True):
            if truncated:
                output = output[:rng.randint(1, len(output))]
            whole = run_chain(ThinkReasoningParser(), MistralToolParser([WEATHER_TOOL, TIME_TOOL]), [output], truncated)
            if not truncated:
                assert all(name in ("get_weather", "get_time") and isinstance(json.loads(args), dict)
                           for name, args in whole[2]), output
            for _ in range(10):
                chunks = random_chunks(rng, output)
                got = run_chain(ThinkReasoningParser(), MistralToolParser([WEATHER_TOOL, TIME_TOOL]), chunks, truncated)
                assert got == whole, chunks


@pytest.mark.parametrize("opening", ['[TOOL_CALLS]get_weather[ARGS]{"city": "x" Note: ',
                                     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "x" Note: '])
def test_a_long_call_that_broke_is_text_however_it_was_chunked(opening):
    """Past 4 KB an object is decoded only at a '}': a break no '}' followed was seen by finish() alone, which made a
    cut call of it when the output came whole (or the break came in a long piece) but text when it came token by
    token. The break makes it text both ways, stopped or cut, as it does in a shorter call."""
    text = opening + "y" * 5000
    long_piece = [text[:20], text[20:4110], text[4110:]]  # the break arrives with the buffer past 4 KB
    rng = random.Random(5)
    for truncated in (False, True):
        for chunks in [[text], list(text), long_piece] + [random_chunks(rng, text) for _ in range(5)]:
            assert as_tuple(stream_tools(MistralToolParser, chunks, truncated)) == (text, []), (truncated, len(chunks))


def test_call_ids_are_nine_alphanumerics():
    ids = {MistralToolParser().new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)
    assert mistral_call_id("a1b2c3d4e") == "a1b2c3d4e"  # already Mistral's shape: kept
    derived = mistral_call_id("call_0123456789abcdef")
    assert len(derived) == 9 and derived.isalnum() and derived == mistral_call_id("call_0123456789abcdef")
    assert mistral_call_id("call_1") != mistral_call_id("call_2")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def grammar(text):
    return xgr.Grammar.from_ebnf(text)


@pytest.mark.parametrize("markup", [MISTRAL, MISTRAL_COMPACT, MISTRAL_ARGS], ids=["array", "compact", "args"])
def test_forced_calls_are_held_in_each_markup(markup):
    tools = [WEATHER, TIME_TOOL]
    rome = markup.opening("get_weather") + '{"city": "Rome"}' + markup.closing
    now = markup.opening("get_time") + "{}" + markup.closing
    # named: the prompt ends with the group's and the call's opening; the rest is the arguments and the ends
    named = grammar(tool_call_grammar(tools, markup, "get_weather"))
    assert markup.forced_opening("get_weather").startswith(markup.required_prefix)
    assert accepts(named, '{"city": "Rome"}' + markup.closing + markup.group_closing)
    assert not accepts(named, '{"town": "Rome"}' + markup.closing + markup.group_closing)
    # required: the prompt ends with required_prefix; parallel calls follow the separator, then the group closes
    skip = len(markup.required_prefix) - len(markup.group_opening)
    required = grammar(tool_call_grammar(tools, markup, parallel=True))
    assert accepts(required, rome[skip:] + markup.group_closing)
    assert accepts(required, rome[skip:] + markup.separator + now + markup.group_closing)
    assert not accepts(required, rome[skip:] + markup.separator + "Hello" + markup.group_closing)
    single = grammar(tool_call_grammar(tools, markup))
    assert not accepts(single, rome[skip:] + markup.separator + now + markup.group_closing)
    # after a thinking block the whole call is held, its openings included
    with_opening = grammar(tool_call_grammar(tools, markup, parallel=True, with_opening=True))
    assert accepts(with_opening, markup.group_opening + rome + markup.group_closing)


@pytest.mark.parametrize("markup", [MISTRAL, MISTRAL_COMPACT, MISTRAL_ARGS], ids=["array", "compact", "args"])
def test_strict_auto_calls_are_held_in_each_markup(markup):
    strict = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}, TIME_TOOL]
    call = markup.forced_opening("get_weather") + '{"city": "Rome"}' + markup.closing + markup.group_closing
    for parallel in (False, True):
        g = grammar(strict_tools_grammar(strict, markup, parallel))
        assert accepts(g, "It is sunny.") and accepts(g, "Let me look. " + call)
        assert not accepts(g, call.replace("city", "town"))  # a strict function's schema holds
        assert not accepts(g, markup.forced_opening("rm") + "{}" + markup.closing + markup.group_closing)
        assert accepts(g, call + " " + call) == parallel


def test_calls_with_an_id_the_model_writes_are_held_with_it():
    """[CALL_ID] templates: the model writes the id after the forced opening, 9 alphanumerics as the templates check,
    then [ARGS] and the arguments; under "auto" a strict call is held the same way."""
    named = grammar(tool_call_grammar([WEATHER, TIME_TOOL], MISTRAL_CALL_ID, "get_weather"))
    assert MISTRAL_CALL_ID.forced_opening("get_weather") == "[TOOL_CALLS]get_weather[CALL_ID]"
    assert accepts(named, 'a1B2c3D4e[ARGS]{"city": "Rome"}')
    for bad in ('a1b2c3d4[ARGS]{"city": "Rome"}', 'a1b2c3d4e-[ARGS]{"city": "Rome"}', '[ARGS]{"city": "Rome"}',
                'a1b2c3d4e[ARGS]{"town": "Rome"}'):
        assert not accepts(named, bad), bad
    required = grammar(tool_call_grammar([WEATHER, TIME_TOOL], MISTRAL_CALL_ID, parallel=True))
    assert accepts(required, 'get_time[CALL_ID]000000000[ARGS]{}[TOOL_CALLS]get_weather[CALL_ID]zzzzzzzzz[ARGS]'
                             '{"city": "Oslo"}')
    strict = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]
    auto = grammar(strict_tools_grammar(strict, MISTRAL_CALL_ID, False))
    assert accepts(auto, 'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}')
    assert not accepts(auto, 'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"town": "Rome"}')


def test_each_mistral_template_gets_its_markup():
    assert call_markup("mistral", '{{ "[TOOL_CALLS] [" }}') is MISTRAL
    assert call_markup("mistral", '{{ "[TOOL_CALLS][" }}') is MISTRAL_COMPACT
    assert call_markup("mistral", "{{ '[TOOL_CALLS]' + name + '[ARGS]' }}") is MISTRAL_ARGS
    assert call_markup("mistral", "{{ '[TOOL_CALLS]' + name + '[CALL_ID]' + id + '[ARGS]' }}") is MISTRAL_CALL_ID
    assert call_markup("mistral", "") is MISTRAL  # the flag on another template: the oldest shape
    assert call_markup("hermes", "").name == "hermes" and call_markup(None, "") is None


# The shape of Mistral-7B-Instruct-v0.3's template: tools before the last user turn, a call turn as a JSON array
# after [TOOL_CALLS] with each call's 9-character id, results after [TOOL_RESULTS]; other ids raise.
MISTRAL_V3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{% set out = c.function | tojson %}{{ out[:-1] }}, \"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}"
    "{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
MISTRAL_V11_LIKE = MISTRAL_V3_LIKE.replace(
    "[TOOL_CALLS] [{% for c in m.tool_calls %}", "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}").replace(
    "{% set out = c.function | tojson %}{{ out[:-1] }}, \"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}"
    "{% endfor %}]", "{% endfor %}")
MISTRAL_CALL_ID_LIKE = MISTRAL_V11_LIKE.replace("[ARGS]", "[CALL_ID]{{ c.id }}[ARGS]")
SPECIAL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]")


def history(call_id: str, reply_id: str | None = None) -> list[dict]:
    return [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": reply_id or call_id, "content": "sunny"}]


def test_any_call_id_renders_in_a_mistral_template():
    """OpenAI clients send back ids like `call_...`, which Mistral's templates refuse: they render as one derived
    9-character id, the same on the call and on its result."""
    prompt = render_chat(MISTRAL_V3_LIKE, history("call_8f3a2b1c9d0e4f5a6b7c8d9e"), bos_token="<s>", eos_token="</s>")
    derived = mistral_call_id("call_8f3a2b1c9d0e4f5a6b7c8d9e")
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Oslo"}}, "id": "{derived}"}}]' in prompt
    assert f'"call_id": "{derived}"' in prompt
    with pytest.raises(TemplateError, match="length 9"):  # the check the ids get past is the template's own
        render_chat(MISTRAL_V3_LIKE.replace("[TOOL_CALLS]", "[CALLS]"), history("call_1"))


def mistral_engine(template, reply):
    engine = FakeEngine(chat_template=template, special_tokens=SPECIAL)
    engine.reply = reply
    return engine


def sent_prompt(engine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)


def test_mistral_calls_through_the_server():
    """The template picks the mistral parser; with tools the output keeps its special tokens (without them
    [TOOL_CALLS] would never reach the parser), calls come back with 9-character ids, streamed or not, and an
    id sent back renders in the template's history."""
    engine = mistral_engine(MISTRAL_V3_LIKE, f'[TOOL_CALLS] [{OSLO}, {{"name": "get_weather", "arguments": {{}}}}]')
    with serve_engine(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for stream in (False, True):
            r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                               stream=stream)
            calls, content, reason = calls_content_reason(r, stream)
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("get_weather", {"city": "Oslo"}), ("get_weather", {})]
            assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and content == "" and reason == "tool_calls"
            assert engine.requests[-1][2].skip_special_tokens is False
        client.chat.completions.create(model="fake", messages=history(calls[0].id))
        assert f'"id": "{calls[0].id}"' in sent_prompt(engine) and f'"call_id": "{calls[0].id}"' in sent_prompt(engine)
        assert engine.requests[-1][2].skip_special_tokens is True  # no tools: special tokens dropped as usual

        engine.reply = '{"city": "Rome"}}]'
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        assert sent_prompt(engine).endswith('[INST] Weather in Oslo?[/INST][TOOL_CALLS] [{"name": "get_weather", '
                                             '"arguments": ')
        rest = grammar(engine.requests[-1][2].structured_output.grammar)
        assert accepts(rest, engine.reply) and not accepts(rest, '{"town": "Rome"}}]')

        engine.reply = f"{OSLO}]"
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice="required")
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
        assert sent_prompt(engine).endswith("[/INST][TOOL_CALLS] [")


def test_mistral_v11_and_call_id_templates_through_the_server():
    """A template writing [TOOL_CALLS]NAME[ARGS] forces calls in that shape; one whose calls carry a [CALL_ID]
    reads them under "auto" and forces them with the id left to the model (held to 9 alphanumerics)."""
    engine = mistral_engine(MISTRAL_V11_LIKE, '{"city": "Rome"}')
    with serve_engine(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}
        assert sent_prompt(engine).endswith("[/INST][TOOL_CALLS]get_weather[ARGS]")
        client.chat.completions.create(model="fake", messages=history("call_abc"))
        assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}' in sent_prompt(engine)

    engine = mistral_engine(MISTRAL_CALL_ID_LIKE, 'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}')
    with serve_engine(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER])
        assert r.choices[0].message.content == "Sure."
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        engine.reply = 'a1b2c3d4e[ARGS]{"city": "Rome"}'
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        assert sent_prompt(engine).endswith("[/INST][TOOL_CALLS]get_weather[CALL_ID]")
        rest = grammar(engine.requests[-1][2].structured_output.grammar)
        assert accepts(rest, engine.reply) and not accepts(rest, '[ARGS]{"city": "Rome"}')
        engine.reply = 'get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Bern"}'
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice="required")
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Bern"}
        assert sent_prompt(engine).endswith("[/INST][TOOL_CALLS]")
