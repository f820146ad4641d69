"""Property test: for random model outputs (text, good calls, broken calls, reasoning, non-ASCII text) the
parsers chained as ChoiceStream chains them give the same reasoning, content and calls whether the output
comes whole or split at random points; no text is lost (every non-space character outside a parsed call
is content or reasoning); every call names an offered tool with a JSON object for arguments."""

import json
import random
import re

import pytest

from radiance.server.reasoning_parser import HARMONY_MARKERS, HarmonyReasoningParser, ThinkReasoningParser
from radiance.server.tool_parsers import (HarmonyToolParser, HermesToolParser, Llama3JsonToolParser,
                                          ParseDelta, Qwen3CoderToolParser)
from tests.server.test_tool_parsers import WEATHER_TOOL

TEXTS = ["Hello", " world.", "\n\n", "Köln ist schön", " 日本語 ", "🙂", "a < b", " <tool_", "<", "{", "}",
         "</think>", "<think>", "x"]
GOOD = {  # parser -> calls to get_weather, each with its arguments
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n"
                    "</tool_call>", "<tool_call><function=get_weather></function></tool_call>"],
}
BROKEN = {  # markup that is no usable call: text
    "hermes": ["<tool_call>oops</tool_call>", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
               # JSON that breaks before its end: text as soon as it breaks
               "<tool_call>{Note} x</tool_call>", "<tool_call> a tag. </tool_call>",
               '<tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call>'],
    "qwen3_coder": ["<tool_call>oops</tool_call>", "<tool_call><function=rm></function></tool_call>"],
}
PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}
ARGUMENTS = {'{"city": "Zürich"}': {"city": "Zürich"}, "{}": {}}


def random_output(rng: random.Random, markup: str) -> tuple[str, str, int]:
    """(output, the text outside good calls, number of good calls); the output opens with reasoning or text."""
    reasoning = "".join(rng.choice(TEXTS[:7]) for _ in range(3))
    opening = f"<think>{reasoning}</think>" if rng.random() < 0.5 else "Hi"
    pieces, text, calls = [opening], opening.removeprefix("<think>").replace("</think>", ""), 0
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.3:
            pieces.append(rng.choice(GOOD[markup]))
            calls += 1
        else:
            pieces.append(rng.choice(BROKEN[markup]) if kind < 0.45 else rng.choice(TEXTS))
            text += pieces[-1]
    return "".join(pieces), text, calls


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def run_chain(reasoning_parser, tool_parser, chunks, truncated=False):
    """ChoiceStream's order: reasoning first, its content (and harmony's function messages) to the tool parser."""
    reasoning, tools = "", ParseDelta()
    for delta in [reasoning_parser.feed(chunk) for chunk in chunks] + [reasoning_parser.finish()]:
        reasoning += delta.reasoning
        tools += tool_parser.feed(delta.content)
        for message in delta.function_messages:
            tools += tool_parser.function_message(message)
    tools += tool_parser.finish(truncated)
    return reasoning, tools.content, [(c.name, c.arguments) for c in tools.tool_calls]


def non_space(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("markup", sorted(PARSERS))
def test_any_chunking_agrees_and_loses_no_text(markup):
    rng = random.Random(markup)
    for _ in range(150):
        output, outside, num_calls = random_output(rng, markup)
        whole = run_chain(ThinkReasoningParser(), PARSERS[markup]([WEATHER_TOOL]), [output])
        reasoning, content, calls = whole
        assert non_space(reasoning + content) == non_space(outside), output
        assert len(calls) == num_calls and all(name == "get_weather" for name, _ in calls), output
        assert all(json.loads(args) in ARGUMENTS.values() for _, args in calls), output
        for _ in range(20):
            chunks = random_chunks(rng, output)
            assert run_chain(ThinkReasoningParser(), PARSERS[markup]([WEATHER_TOOL]), chunks) == whole, chunks


def test_llama3_json_any_chunking_agrees():
    call = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
    pieces = [call, "; ", " ", '{"name": "rm", "parameters": {}}', '{"a": 1}', "Sunny 🙂.", "<|python_tag|>", "{"]
    rng = random.Random(3)
    for _ in range(200):
        output = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))
        for truncated in (False, True):
            whole = run_chain(ThinkReasoningParser(), Llama3JsonToolParser([WEATHER_TOOL]), [output], truncated)
            if not truncated:
                assert all(json.loads(args) == {"city": "Zürich"} for _, args in whole[2]), output
            for _ in range(10):
                chunks = random_chunks(rng, output)
                got = run_chain(ThinkReasoningParser(), Llama3JsonToolParser([WEATHER_TOOL]), chunks, truncated)
                assert got == whole, chunks


HARMONY_MESSAGES = [
    "<|channel|>analysis<|message|>Think about Köln.<|end|>",
    "<|start|>assistant<|channel|>analysis<|message|>More 日本.<|end|>",
    "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>",
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    '{"city":"Rome"}<|call|>',
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>',
    "<|start|>assistant<|channel|>final<|message|>Sunny 🙂.<|return|>",
]
HARMONY_OUTSIDE = [" ", "\n\n", "to", " to=functions.get_weather", "stray text "]  # text outside messages


def test_harmony_any_chunking_agrees():
    rng = random.Random(5)
    for _ in range(200):
        output = "".join(rng.choice(HARMONY_MESSAGES if rng.random() < 0.7 else HARMONY_OUTSIDE)
                         for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.3:  # cut off by max_tokens, between tokens: a marker is one (special) token
            tokens = [t for t in re.split("(" + "|".join(map(re.escape, HARMONY_MARKERS)) + ")", output) if t]
            output = "".join(tokens[:rng.randint(1, len(tokens))])
        whole = run_chain(HarmonyReasoningParser(), HarmonyToolParser([WEATHER_TOOL]), [output])
        assert not any(mark in whole[0] + whole[1] for mark in ("<|", "|>")), output
        for _ in range(10):
            chunks = random_chunks(rng, output)
            assert run_chain(HarmonyReasoningParser(), HarmonyToolParser([WEATHER_TOOL]), chunks) == whole, chunks


@pytest.mark.parametrize("markup", sorted(PARSERS))
def test_any_chunking_agrees_when_max_tokens_cuts_anywhere(markup):
    rng = random.Random(markup + "cut")
    for _ in range(150):
        output, _, _ = random_output(rng, markup)
        output = output[:rng.randint(1, len(output))]
        whole = run_chain(ThinkReasoningParser(), PARSERS[markup]([WEATHER_TOOL]), [output], truncated=True)
        for _ in range(10):
            chunks = random_chunks(rng, output)
            got = run_chain(ThinkReasoningParser(), PARSERS[markup]([WEATHER_TOOL]), chunks, truncated=True)
            assert got == whole, chunks


@pytest.mark.parametrize("markup", sorted(PARSERS))
def test_any_chunking_agrees_when_the_prompt_opened_thinking(markup):
    rng = random.Random(markup + "inside")
    for _ in range(150):
        output, _, _ = random_output(rng, markup)
        output = rng.choice(["", "<think>", " <think>\n"]) + output.removeprefix("<think>")
        whole = run_chain(ThinkReasoningParser(starts_inside=True), PARSERS[markup]([WEATHER_TOOL]), [output])
        assert "<think>" not in whole[0][:8], output  # a repeated opening tag is dropped
        for _ in range(10):
            chunks = random_chunks(rng, output)
            got = run_chain(ThinkReasoningParser(starts_inside=True), PARSERS[markup]([WEATHER_TOOL]), chunks)
            assert got == whole, chunks
