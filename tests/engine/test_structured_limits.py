"""Constraints structured output cannot serve are refused up front, with one line naming the place: JSON-schema
keywords xgrammar compiles but does not enforce, schemas and choice lists it would take minutes to compile,
grammars no text satisfies. And the compile cache: one compile per constraint, bounded in bytes."""

from __future__ import annotations

import json
import time

import pytest

from radiance.engine import structured_output
from radiance.engine.structured_output import (MAX_ENUM_VALUES, GrammarBackend, StructuredOutput,
                                               StructuredOutputError)
from tests.engine.conftest import tiny_byte_bpe_tokenizer


@pytest.fixture(scope="module")
def backend():
    return GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])


def accepts_grammar(grammar: str, text: str) -> bool:
    """Whether the tool-call grammar (a named call: what follows `"arguments": `) takes `text` whole."""
    matcher = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0]).matcher(StructuredOutput(grammar=grammar)).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def accepts(backend, spec: StructuredOutput, text: str) -> bool:
    state = backend.matcher(spec)
    return state.matcher.accept_string(text) and state.matcher.is_completed()


# each schema with a text xgrammar 0.2.9 let through though the schema refuses it
UNENFORCED = [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]},
     "'not' (at #/properties/a)"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "'if' (at #)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentSchemas": {"a": {"required": ["b"]}}},
     "'dependentSchemas'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "'allOf' of 2 schemas"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' (at #)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "'required' names 'b'"),
    ({"type": "array", "items": {"type": "object", "required": ["b"]}}, "'required' names 'b' (at #/items)"),
]


@pytest.mark.parametrize("schema,place", UNENFORCED, ids=[place.split("'")[1] for _, place in UNENFORCED])
def test_keywords_the_grammar_would_not_enforce_are_refused(backend, schema, place):
    with pytest.raises(StructuredOutputError, match="invalid json constraint: .*cannot") as err:
        backend.compile(StructuredOutput(json=schema))
    assert place in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"allOf": [{"type": "integer", "minimum": 5}]}, "7", "1"),
    ({"type": "integer", "multipleOf": 5}, "10", "3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    ({"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}},  # property names
     '{"not": 1, "if": "x"}', '{"not": "x"}'),
])
def test_keywords_it_enforces_are_served(backend, schema, valid, invalid):
    spec = StructuredOutput(json=schema)
    assert accepts(backend, spec, valid) and not accepts(backend, spec, invalid)


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def nested_text(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


TOO_LARGE = {  # each took xgrammar from 20 s to many minutes (a compile thread no request can cancel)
    "enum": (lambda: StructuredOutput(json={"enum": [f"value number {i}" for i in range(20000)]}),
             "20000 enum and const"),
    "enums in all": (lambda: StructuredOutput(json={"type": "object", "properties": {
        f"p{i}": {"enum": [f"v{i}-{j}" for j in range(100)]} for i in range(11)}}), "1100 enum and const"),
    "choice": (lambda: StructuredOutput(choice=[f"choice {i}" for i in range(20000)]), "20000 choices"),
    "pattern": (lambda: StructuredOutput(json={"type": "string", "pattern": "^a{50000}$"}), "repetition counts"),
    "patterns in all": (lambda: StructuredOutput(json={"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "^[a-z]{1,2000}$"} for i in range(100)}}), "repetition counts"),
    # 2,000 deep ran for minutes; past Python's recursion limit, a RecursionError was a 500
    "depth": (lambda: StructuredOutput(json=nested_text(2000)), "nested too deeply"),
    "depth as a dict": (lambda: StructuredOutput(json=nested(5000)), "nested too deeply"),
    "depth under the parser's limit": (lambda: StructuredOutput(json=nested(150)), "nested more than 100 deep"),
}


@pytest.mark.parametrize("name", TOO_LARGE)
def test_constraints_too_large_to_compile_are_refused_at_once(backend, name):
    make, message = TOO_LARGE[name]
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match=message):
        backend.compile(make())
    assert time.monotonic() - start < 2.0
    assert accepts(backend, StructuredOutput(json={"enum": [f"v{j}" for j in range(MAX_ENUM_VALUES)]}), '"v999"')


def test_tool_schemas_too_large_to_compile_are_refused():
    from radiance.engine.tool_grammars import HERMES, strict_tools_grammar, tool_call_grammar

    huge = {"type": "object", "properties": {"x": {"enum": [f"value number {i}" for i in range(20000)]}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": huge, "strict": True}},
             {"type": "function", "function": {"name": "g"}}]
    with pytest.raises(StructuredOutputError, match="20000 enum"):
        tool_call_grammar(tools, HERMES)
    with pytest.raises(StructuredOutputError, match="20000 enum"):
        strict_tools_grammar(tools, HERMES, parallel=False)
    named = tool_call_grammar(tools, HERMES, name="g")  # only the named function's schema is compiled
    assert "value number" not in named and accepts_grammar(named, '{"any": 1}}\n</tool_call>')
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}]
    # tools' keywords are let through (schemas written for models): "not" a string, yet a string is accepted
    assert accepts_grammar(tool_call_grammar(loose, HERMES, name="f"), '{"x": "a string"}}\n</tool_call>')


@pytest.mark.parametrize("spec", [StructuredOutput(grammar="root ::= root"),
                                  StructuredOutput(grammar='root ::= b\nb ::= b "c"')])
def test_a_grammar_no_text_satisfies_is_refused(backend, spec):
    """`root ::= root` compiled, allowed no first token, and its request ended at once on token 0 ("finish_reason
    stop", a token the grammar refused)."""
    with pytest.raises(StructuredOutputError, match="no text satisfies it"):
        backend.compile(spec)
    assert accepts(backend, StructuredOutput(regex=""), "")  # the empty text is some text: it ends at once


def test_a_constraint_compiles_once_and_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", 2 << 20)
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    spec = StructuredOutput(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    backend.compile(spec)
    size = backend.compiler.get_cache_size_bytes()
    backend.compile(StructuredOutput(json=json.loads(spec.json)))  # an equal schema: a cache hit
    assert backend.compiler.get_cache_size_bytes() == size
    for i in range(300):
        backend.compile(StructuredOutput(json={"type": "object", "properties": {f"key{i}": {"type": "string"}}}))
    assert size < backend.compiler.get_cache_size_bytes() <= 2 << 20
