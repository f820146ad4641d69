"""An optional thinking block before a constraint (StructuredOutput.after_reasoning="optional_think", set by the
server where the prompt opened no <think> but the model may write one first: Qwen3's hybrid template with thinking
on, DeepSeek-R1-style models): `<think>` free text `</think>` whitespace then the constrained answer, or the answer
alone, held from the first token. (vLLM applies the grammar only once its reasoning parser saw </think>, so there a
model that does not think is never held.) JSON is the engine's compact form: one space after ':' and ','."""

import pytest
from xgrammar.testing import _is_grammar_accept_string

from radiance.engine.structured_output import (REASONING_BEFORE, StructuredOutput, _grammar,
                                               after_reasoning)
from radiance.engine.tool_grammars import HERMES, QWEN3_CODER, tool_call_grammar
from tests.engine.test_structured_after_reasoning import accepts, backend  # noqa: F401 (fixture)

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
PLAN = 'plan {with json} {"a": "x"} <tool_call> maybe'  # the reasoning is free text


def held(spec: StructuredOutput):
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(after_reasoning(_grammar(spec), spec.after_reasoning))


def test_the_format_is_known():
    assert "optional_think" in REASONING_BEFORE
    assert StructuredOutput(json=SCHEMA, after_reasoning="optional_think").after_reasoning == "optional_think"


@pytest.mark.parametrize("text, ok", [
    ('<think>plan {with json}</think>\n\n{"a": 1}', True),
    ("<think>" + PLAN + "</think>\n\n" + '{"a": 1}', True),
    ('<think></think>{"a": 1}', True),  # an empty block, no whitespace
    ('{"a": 1}', True),  # no block at all: the answer is held from the start
    ('plan {"a": 1}', False),  # reasoning without the tags is no reasoning
    ('<think>plan</think>\n\n{"a": "one"}', False),  # the answer after the block is held
    ('<think>plan</think>\n\nThe answer is {"a": 1}', False),
    ('plan</think>\n\n{"a": 1}', False),  # the block must be opened: the prompt did not
    ('{"a": 1}<think>late</think>', False),  # only at the start
    ('<think>plan</think>\n\n<think>again</think>{"a": 1}', False),  # one block
    (' {"a": 1}', False),
])
def test_json_after_an_optional_thinking_block(text, ok):
    assert _is_grammar_accept_string(held(StructuredOutput(json=SCHEMA, after_reasoning="optional_think")),
                                     text) is ok


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutput(regex="yes|no", after_reasoning="optional_think"), "yes", "maybe"),
    (StructuredOutput(choice=("left", "right"), after_reasoning="optional_think"), "right", "up"),
    (StructuredOutput(grammar='root ::= "A" [0-9]+', after_reasoning="optional_think"), "A42", "B42"),
    (StructuredOutput(json_object=True, after_reasoning="optional_think"), '{"b": [1]}', "b is 1"),
])
def test_every_kind_of_constraint(spec, good, bad):
    grammar = held(spec)
    for before in ("", "<think>" + PLAN + "</think>\n\n", "<think>\n" + PLAN + "\n</think>"):
        assert _is_grammar_accept_string(grammar, before + good)
        assert not _is_grammar_accept_string(grammar, before + bad)
    assert not _is_grammar_accept_string(grammar, PLAN + " " + good)


def test_the_engine_compiles_and_holds_it_over_a_real_tokenizer(backend):
    spec = StructuredOutput(json=SCHEMA, after_reasoning="optional_think")
    assert accepts(backend, spec, "<think>" + PLAN + "</think>\n\n" + '{"a": 1}')
    assert accepts(backend, spec, '{"a": 1}')
    assert not accepts(backend, spec, 'plan {"a": 1}')
    assert not accepts(backend, spec, '<think>plan</think>{"a": 1.5}')


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALLS = {
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    QWEN3_CODER: "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("markup", [HERMES, QWEN3_CODER], ids=["hermes", "qwen3_coder"])
@pytest.mark.parametrize("named", [None, "get_weather"])
def test_a_forced_call_after_an_optional_block_writes_its_own_opening(backend, markup, named):
    """The prompt cannot end with the call's opening when a block may come first: the grammar holds the whole
    call, its opening included, after the block or from the start."""
    call = CALLS[markup]
    spec = StructuredOutput(grammar=tool_call_grammar(TOOLS, markup, named, with_opening=True),
                            after_reasoning="optional_think")
    assert accepts(backend, spec, "<think>" + PLAN + "</think>\n\n" + call)
    assert accepts(backend, spec, call)  # no thinking: the call from the first token
    assert not accepts(backend, spec, PLAN + "</think>\n\n" + call)  # the block needs its opening
    assert not accepts(backend, spec, "<think>" + PLAN + "</think>\n\nSunny.")  # the answer is the call
    assert not accepts(backend, spec, "Sunny.")
    assert not accepts(backend, spec, call[len("<tool_call>\n"):])  # its opening included
    assert not accepts(backend, spec, call.replace("get_weather", "get_date"))  # no such tool
    assert not accepts(backend, spec, call.replace("city", "town"))  # held to the function's schema
