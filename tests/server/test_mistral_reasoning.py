"""Magistral's reasoning: the `mistral` reasoning parser reads `[THINK] ... [/THINK]` (control tokens) at every chunk
boundary, a template that writes [THINK] picks it, and through the server the reasoning comes back apart from the
answer and from Mistral tool calls, streamed or not."""

import json

import openai
import pytest

from radiance.server.reasoning_parser import MistralReasoningParser, split_reasoning
from radiance.server.tool_parsers import MistralToolParser
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.test_mistral_tools import MISTRAL_V11_LIKE, SPECIAL, WEATHER, history
from tests.server.test_parsers_property import run_chain
from tests.server.test_tool_parsers import WEATHER_TOOL, chunkings

CASES = [
    # (output, reasoning, content)
    ("[THINK]The user wants the capital.[/THINK]Paris.", "The user wants the capital.", "Paris."),
    ("[THINK]\nStep 1.\n[/THINK]\n\nParis.", "Step 1.\n", "Paris."),
    ("Paris, without thinking.", "", "Paris, without thinking."),
    ("[THINK]cut off while thin", "cut off while thin", ""),
    ("[THI", "", "[THI"),
    ("a [THINK] later stays content", "", "a [THINK] later stays content"),
    ("<think>not Mistral's</think>x", "", "<think>not Mistral's</think>x"),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_think_tokens_at_every_chunk_boundary(text, reasoning, content):
    whole = split_reasoning(MistralReasoningParser(), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for chunks in chunkings(text):
        parser = MistralReasoningParser()
        got_r, got_c = "", ""
        for chunk in chunks + [None]:
            d = parser.feed(chunk) if chunk is not None else parser.finish()
            got_r, got_c = got_r + d.reasoning, got_c + d.content
        assert (got_r, got_c) == (reasoning, content), chunks


def test_reasoning_then_a_call_streams_like_the_whole():
    text = '[THINK]need the weather[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    for chunks in chunkings(text):
        reasoning, content, calls = run_chain(MistralReasoningParser(), MistralToolParser([WEATHER_TOOL]), chunks)
        assert reasoning == "need the weather" and content == ""
        assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Oslo"})]


# Magistral Small 2509's shape: a default system prompt that asks for [THINK]...[/THINK], then Mistral v11 turns
MAGISTRAL_LIKE = ("{{ bos_token }}[SYSTEM_PROMPT]First draft your thinking process inside [THINK] ... [/THINK], "
                  "then answer.[/SYSTEM_PROMPT]" + MISTRAL_V11_LIKE.replace("{{ bos_token }}", ""))


def test_magistral_reasoning_through_the_server():
    engine = FakeEngine(chat_template=MAGISTRAL_LIKE, special_tokens=SPECIAL + ("[THINK]", "[/THINK]"))
    engine.reply = "[THINK]France's capital.[/THINK]Paris."
    with serve_engine(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Capital of France?"}]
        r = client.chat.completions.create(model="fake", messages=messages)
        message = r.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == ("Paris.", "France's capital.")
        assert engine.requests[-1][2].skip_special_tokens is False  # [THINK] must reach the parser
        chunks = list(client.chat.completions.create(model="fake", messages=messages, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Paris."
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "France's capital."

        engine.reply = '[THINK]Look it up.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER])
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"] == "Look it up." and not message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})]
        assert r.choices[0].finish_reason == "tool_calls"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_constraint_lets_magistral_think_first_and_holds_the_answer():
    """response_format or a forced call on Magistral: a [THINK] block the model may open first runs free, the text
    after [/THINK] (or from the first token, without one) is held; the server splits them as usual."""
    from tests.server.test_parser_followups import accepts

    engine = FakeEngine(chat_template=MAGISTRAL_LIKE, special_tokens=SPECIAL + ("[THINK]", "[/THINK]"))
    engine.reply = '[THINK]One field.[/THINK]{"a": 1}'
    with serve_engine(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "JSON please"}],
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "a", "schema": SCHEMA}})
        message = r.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == ('{"a": 1}', "One field.")
        spec = engine.requests[-1][2].structured_output
        assert spec.after_reasoning == "optional_mistral_think"
        assert accepts(spec, engine.reply) and accepts(spec, '{"a": 1}')
        for bad in ('[THINK]One field.[/THINK]{"a": "one"}', '<think>One field.</think>{"a": 1}',
                    'One field.[/THINK]{"a": 1}'):
            assert not accepts(spec, bad), bad

        engine.reply = '[THINK]Look it up.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        r = client.chat.completions.create(model="fake", messages=history("x")[:1], tools=[WEATHER],
                                           tool_choice="required")
        assert r.choices[0].message.model_extra["reasoning_content"] == "Look it up."
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        sent = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
        assert sent.endswith("[/INST]")  # the model writes the call's opening after its reasoning
        spec = engine.requests[-1][2].structured_output
        assert accepts(spec, engine.reply) and accepts(spec, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
        assert not accepts(spec, "[THINK]Look it up.[/THINK]It is sunny.")
