"""Structured output through the server on the embedded SmolLM2 (CPU): constraints it cannot serve are 400s
naming their field and the server serves on; what it generates holds to the schema with n > 1, a seed,
streaming, a max_tokens cut and a min_tokens no valid output reaches."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from radiance.engine.async_engine import AsyncLLMEngine
from radiance.engine.structured_output import StructuredOutput
from tests.server.fake_engine import serve_engine

ASK = [{"role": "user", "content": "Describe Ann, a 31-year-old teacher who loves tea."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def is_person(text: str) -> bool:
    """The schema checked by hand: the two keys in order, a capitalized name, an age in range."""
    value = json.loads(text)
    return (list(value) == ["name", "age"] and re.fullmatch("[A-Z][a-z]{1,12}", value["name"]) is not None
            and type(value["age"]) is int and 0 <= value["age"] <= 150)


@pytest.fixture(scope="module")
def url(smollm2):
    with serve_engine(AsyncLLMEngine(engine=smollm2.engine)) as base:
        yield base


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, **body}, timeout=60)


UNSERVABLE = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format", "'not'"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}}, "guided_json",
     "'required' names 'b'"),
    ({"structured_outputs": {"json": {"enum": [f"v{i}" for i in range(5000)]}}}, "structured_outputs", "5000 enum"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "no text satisfies it"),
    ({"guided_choice": ["yes", ""]}, "guided_choice", "non-empty"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
]


@pytest.mark.parametrize("body,param,message", UNSERVABLE, ids=[p for _, p, _ in UNSERVABLE])
def test_unservable_constraints_are_400s_naming_the_field(url, body, param, message):
    r = chat(url, **body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and message in error["message"], r.text
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    ok = chat(url, max_tokens=3)  # the server serves on
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_n_seeded_choices_hold_to_the_schema_streamed_or_not(url):
    body = dict(n=3, seed=11, temperature=1.0, response_format=PERSON_FORMAT)
    whole = chat(url, **body).json()["choices"]
    assert [c["finish_reason"] for c in whole] == ["stop"] * 3
    assert all(is_person(c["message"]["content"]) for c in whole)
    r = chat(url, stream=True, **body)
    texts = ["", "", ""]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in whole]  # the seed makes choice i the same again


def test_a_cut_output_is_a_valid_prefix(url, smollm2):
    choice = chat(url, max_tokens=5, response_format=PERSON_FORMAT).json()["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "length" and text.startswith("{")
    state = smollm2.engine.grammar_backend().matcher(StructuredOutput(json=PERSON))
    assert state.matcher.accept_string(text) and not state.matcher.is_completed()


def test_min_tokens_past_every_valid_output_still_ends_valid(url):
    """min_tokens bans the end until then, but the grammar allows nothing else after "yes": the constraint wins."""
    choice = chat(url, min_tokens=20, guided_choice=["yes", "no"], temperature=0).json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"

