"""What of a JSON schema structured output serves (engine.json_schema_rules): what xgrammar 0.2.9 would compile but
not enforce is refused with its place named; what it serves wrongly is rewritten. The grammars are walked at
random on a character-level vocabulary that includes '"', '\\' and control characters, and every text they let
finish is parsed and validated with jsonschema (a black-box hunt found JSON that did not parse, or broke the
schema, with finish_reason "stop")."""

from __future__ import annotations

import json
import random

from typing import Literal, Optional, Union

import pytest
import torch
import xgrammar as xgr
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field, HttpUrl, constr

from radiance.engine.json_schema_grammar import compile_json_schema
from radiance.engine.json_schema_rules import check_json_schemas, served_schema
from radiance.engine.structured_output import GrammarBackend, StructuredOutput, StructuredOutputError, after_reasoning, _grammar
from radiance.engine.tool_grammars import HERMES, tool_call_grammar
from tests.engine.conftest import tiny_byte_bpe_tokenizer

class Cat(BaseModel):
    kind: Literal["cat"] = "cat"  # a tag with a default: pydantic leaves it out of `required`
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"] = "dog"
    name: str


class Owner(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")
    code: constr(pattern=r"^[A-Z]{3}$", max_length=3)
    slug: str = Field(pattern=r"^[a-z0-9-]+$", min_length=1)
    site: HttpUrl  # format uri, 1 to 2083 characters
    nick: Optional[str] = Field(None, max_length=8)


# printable ASCII, the characters JSON must escape, and a few beyond ASCII
CHARS = [chr(c) for c in range(0x20, 0x7f)] + ["\t", "\n", "\x01", "\x1f", "é", "名", "😀"]
STOP = len(CHARS)


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(CHARS + ["<eos>"], stop_token_ids=[STOP])
    return xgr.GrammarCompiler(info, max_threads=1)


def walk(compiled, rng: random.Random, max_steps: int = 200) -> str | None:
    """A random text the grammar lets finish (None if it did not finish in max_steps); closing characters are
    favoured so that most walks end."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, STOP + 1)
    closers = {CHARS.index(c) for c in '"}],'} | {STOP}
    text = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return "".join(text)
        matcher.fill_next_token_bitmask(mask)
        allowed = torch.nonzero(xgr.testing.bitmask_to_bool_mask(mask, STOP + 1)[0]).flatten().tolist()
        closing = [t for t in allowed if t in closers]
        token = rng.choice(closing if closing and rng.random() < 0.3 else allowed)
        assert matcher.accept_token(token)
        if token != STOP:
            text.append(CHARS[token])
    return None


def refused(schema) -> str:
    with pytest.raises(StructuredOutputError) as info:
        check_json_schemas({"#": schema}, "invalid json constraint")
    return str(info.value)


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SERVED = {  # schemas served exactly; the hunt's invalid outputs came from the first three
    "length-bounded string": obj(v={"type": "string", "minLength": 2, "maxLength": 6}),
    "min length only": obj(v={"type": "string", "minLength": 3}),
    "length in a nested array": obj(v={"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}),
    "pattern of printable ASCII without the escapes": obj(v={"type": "string", "pattern": r"^[ !#-\[\]-~]{1,8}$"}),
    "pattern of printable ASCII": obj(v={"type": "string", "pattern": r"^[ -~]{1,8}$"}),  # '"' and '\' left out
    "pattern that implies its length bounds": obj(v={"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3}),
    "enum beside its type": obj(v={"type": "string", "enum": ["a", 1, None, "b"]}),
    "integer with fractional bounds": obj(v={"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.5}),
    "oneOf told apart by type": obj(v={"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}),
    "discriminated union": {
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                          "required": ["kind", "lives"], "additionalProperties": False},
                  "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "name": {"type": "string"}},
                          "required": ["kind", "name"], "additionalProperties": False}},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}},
    "optional field as pydantic writes it": obj(v={"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}],
                                                   "default": None, "title": "V"}),
    "propertyNames with a length": {"type": "object", "propertyNames": {"maxLength": 2},
                                    "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "pydantic model": Owner.model_json_schema(),
}


@pytest.mark.parametrize("name", list(SERVED))
def test_every_text_a_served_schema_lets_finish_is_json_that_validates(compiler, name):
    schema = SERVED[name]
    check_json_schemas({"#": schema}, "invalid json constraint")  # served, not refused
    compiled = compile_json_schema(compiler, json.dumps(schema))
    validator, rng, finished = Draft202012Validator(schema), random.Random(name), 0
    for _ in range(30):
        text = walk(compiled, rng)
        if text is None:
            continue
        finished += 1
        value = json.loads(text)  # raises on raw control characters or unescaped quotes
        assert not list(validator.iter_errors(value)), (text, [e.message for e in validator.iter_errors(value)])
    assert finished >= 10


def test_a_length_bounded_string_takes_json_escapes_and_refuses_raw_control_characters():
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    spec = StructuredOutput(json={"type": "string", "maxLength": 4})

    def accepts(text: str) -> bool:
        matcher = backend.matcher(spec).matcher
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(r'"a\tb"') and accepts(r'"\"\\"') and accepts(r'"\u00e9"') and accepts('"abcd"')
    assert not accepts('"a\tb"') and not accepts('"abcde"') and not accepts(r'"\ud83d"')


@pytest.mark.parametrize("schema, says", [
    (obj(v={"type": "string", "pattern": r"^a\\b$"}), "can match '\"', '\\' or a control character"),
    (obj(v={"type": "string", "pattern": r'^["\\]+$'}), "can match '\"'"),
    (obj(v={"type": "string", "pattern": r"^\t$"}), "control character"),
    (obj(v={"type": "string", "pattern": r'^[\p{L}"]+$'}), "Unicode property class"),  # Python cannot parse it
    (obj(v={"type": "string", "pattern": r"^(?<y>\d{4})(?=-)"}), "lookahead"),  # ECMA's named group
    (obj(v={"type": "string", "format": "email", "maxLength": 10}), "'format' with 'minLength' / 'maxLength'"),
    (obj(v={"type": "string", "pattern": "^[A-Z]{3,5}$", "maxLength": 4}), "it allows other lengths"),
    (obj(v={"type": "string", "pattern": r"^(?=.*\d)[a-z0-9]{3}$"}), "lookahead or lookbehind"),
    (obj(v={"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}), "'pattern' with 'minLength' / 'maxLength'"),
    (obj(v={"type": "string", "format": "email", "pattern": "^a"}), "'pattern' with 'format'"),
    (obj(v={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "'uniqueItems' (at #/properties/v)"),
    (obj(v={"type": "array", "items": {"type": "integer"}, "contains": {"const": 4}}), "'contains'"),
    ({**obj(a={"type": "integer"}), "dependentRequired": {"a": ["b"]}}, "'dependentRequired' (at #)"),
    (obj(v={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "'oneOf' (at #/properties/v) is enforced only as"),
    (obj(v={"oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {"const": 1}}}]}), "may overlap"),
    (obj(v={"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^z"}]}), "'type' beside 'anyOf'"),
    ({"$defs": {"s": {"type": "string"}}, **obj(v={"$ref": "#/$defs/s", "maxLength": 2})}, "'maxLength' beside '$ref'"),
    (obj(v={"$ref": "#anchor"}), "not a JSON pointer"),
    (obj(v={"$ref": "https://example.com/s.json"}), "not a JSON pointer"),
    (obj(v={"maxLength": 2}), "add '\"type\": \"string\"'"),
    (obj(v={"minimum": 5}), "add '\"type\": \"number\"'"),
    (obj(v={"type": "string", "maxLength": -1}), "'maxLength' (at #/properties/v) must be a non-negative integer"),
    (obj(v={"type": "string", "enum": [1, 2]}), "no value of 'enum' (at #/properties/v) is of its type"),
    (obj(v={"type": "integer", "maximum": 10**19}), "beyond the 64-bit integers"),
])
def test_what_the_grammar_would_not_enforce_is_refused_with_its_place(schema, says):
    assert says in refused(schema)


def test_served_schemas_keep_what_they_allow():
    rewritten = served_schema(obj(v={"type": "string", "enum": ["a", 1]},
                                  n={"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.5}))
    assert rewritten["properties"]["v"]["enum"] == ["a"]
    assert rewritten["properties"]["n"] == {"type": "integer", "minimum": 2, "maximum": 4}


def test_a_tool_pattern_that_names_json_escapes_is_dropped_and_its_call_stays_json():
    """Tools are not refused for their keywords (schemas written for models); a pattern that would write '\\'
    unescaped corrupted the arguments ("C:\\tmp" read back as a tab) or left the call unparsed."""
    tools = [{"type": "function", "function": {"name": "open", "parameters": obj(
        path={"type": "string", "pattern": r"^C:\\[a-z]{1,4}$"}, note={"type": "string", "maxLength": 5})}}]
    assert "pattern" not in served_schema(tools[0]["function"]["parameters"], for_tools=True)["properties"]["path"]
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    grammar = tool_call_grammar(tools, HERMES, name="open")

    def accepts(arguments: str) -> bool:
        matcher = backend.matcher(StructuredOutput(grammar=grammar)).matcher
        return matcher.accept_string(arguments + "}\n</tool_call>") and matcher.is_completed()

    assert accepts(r'{"path": "C:\\tmp", "note": "a\tb"}')
    assert not accepts(r'{"path": "C:\qx", "note": "ab"}')  # a backslash that escapes nothing JSON knows
    assert not accepts('{"path": "x", "note": "a\tb"}')  # a raw tab


def test_a_request_s_own_regex_keeps_its_meaning_after_reasoning():
    """Only grammars built from JSON schemas get JSON's string characters: a regex whose rule looks like one was
    patched too once it followed a reasoning block, flipping what it took."""
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    for reasoning in (None, "think"):
        matcher = backend.matcher(StructuredOutput(regex=r'[^"\\\r\n]{1,3}', after_reasoning=reasoning)).matcher
        lead = "</think>\n\n" if reasoning else ""
        assert matcher.accept_string(lead + "a\tb") and matcher.is_completed(), reasoning


def test_a_pattern_with_latin_1_characters_compiles_after_reasoning():
    """xgrammar prints [éèa-z] as [\\xe9\\xe8a-z], which its parser read back as \\xe8a: every grammar that goes
    through EBNF text (a constraint after reasoning, tool calls) failed to compile."""
    spec = StructuredOutput(json=obj(v={"type": "string", "pattern": "^[éèa-z]{1,5}$"}))
    xgr.Grammar.from_ebnf(after_reasoning(_grammar(spec), "think"))
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    matcher = backend.matcher(StructuredOutput(json=spec.json, after_reasoning="think")).matcher
    assert matcher.accept_string('</think>\n\n{"v": "été"}') and matcher.is_completed()


@pytest.mark.parametrize("strict", [True, False])
def test_a_strict_function_s_unenforced_keywords_are_refused_and_others_let_through(strict):
    """A strict function promises arguments that follow its schema (OpenAI's strict mode refuses what it cannot
    hold); other tools' schemas are written for models and only their size is checked."""
    tools = [{"type": "function", "function": {"name": "pick", "strict": strict, "parameters": obj(
        ids={"type": "array", "items": {"type": "integer"}, "uniqueItems": True})}}]
    if strict:
        with pytest.raises(StructuredOutputError, match=r"'uniqueItems' \(at functions\['pick'\]\.parameters#"):
            tool_call_grammar(tools, HERMES, name="pick")
    else:  # let through: a call repeating an id is accepted (uniqueItems is not enforced, as for a model)
        grammar = tool_call_grammar(tools, HERMES, name="pick")
        matcher = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0]).matcher(StructuredOutput(grammar=grammar))
        assert matcher.matcher.accept_string('{"ids": [1, 1]}}\n</tool_call>') and matcher.matcher.is_completed()
