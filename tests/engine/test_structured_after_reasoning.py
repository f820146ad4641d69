"""A constraint placed after the model's reasoning (StructuredOutput.after_reasoning, set by the server) keeps the
constraint's own checks and messages, and holds only the text after the reasoning."""

import pytest

from radiance.engine.structured_output import GrammarBackend, StructuredOutput, StructuredOutputError
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer


@pytest.fixture(scope="module")
def backend():
    tokenizer = tiny_byte_bpe_tokenizer()
    return GrammarBackend(tokenizer, TINY_TOKENIZER_VOCAB, [tokenizer.eos_token_id])


def accepts(backend, spec, text):
    matcher = backend.matcher(spec).matcher
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutput(json='{"type": "integer"}', after_reasoning="think"), "plan</think>\n\n12", 'plan</think>"12"'),
    (StructuredOutput(regex="yes|no", after_reasoning="think"), "a {b} c</think>yes", "yes"),
    (StructuredOutput(choice=("A", "B"), after_reasoning="harmony"),
     "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>B", "B"),
    (StructuredOutput(grammar='root ::= "hi"', after_reasoning="harmony"), "<|channel|>final<|message|>hi",
     "<|channel|>analysis<|message|>hi"),
])
def test_the_constraint_holds_the_text_after_the_reasoning(backend, spec, good, bad):
    assert accepts(backend, spec, good)
    assert not accepts(backend, spec, bad)


def test_the_constraint_keeps_its_checks_and_messages(backend):
    with pytest.raises(StructuredOutputError, match="invalid json constraint: 'not'"):
        backend.compile(StructuredOutput(json='{"not": {"type": "string"}}', after_reasoning="harmony"))
    with pytest.raises(StructuredOutputError, match="invalid regex constraint"):
        backend.compile(StructuredOutput(regex="((", after_reasoning="think"))
    with pytest.raises(StructuredOutputError, match="unknown reasoning format"):
        StructuredOutput(json_object=True, after_reasoning="channels")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("named", [None, "get_weather"])
def test_a_forced_call_after_the_reasoning_writes_its_own_opening(backend, named):
    """A template that opened <think>: the prompt cannot end with the call's opening, so the grammar holds the
    whole call, opening included, after the reasoning (tool_call_grammar with_opening)."""
    from radiance.engine.tool_grammars import HERMES, tool_call_grammar

    spec = StructuredOutput(grammar=tool_call_grammar(TOOLS, HERMES, named, with_opening=True),
                            after_reasoning="think")
    plan = 'Call {"name": "get_time"}? <tool_call> maybe.'
    assert accepts(backend, spec, plan + "</think>\n\n" + CALL)
    assert not accepts(backend, spec, CALL)  # the call is not the reasoning
    assert not accepts(backend, spec, plan + "</think>\n\nSunny.")  # the answer is the call
    assert not accepts(backend, spec, plan + "</think>\n\n" + CALL[len("<tool_call>\n"):])  # its opening included
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(backend, spec, plan + "</think>" + time_call) is (named is None)
