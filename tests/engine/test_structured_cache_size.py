"""The caches of schema grammars and constraint checks hold a count of entries of any size (soak report F4): a
text over MAX_CACHED_TEXT is computed uncached instead, with the same result."""

from __future__ import annotations

import json

import pytest

from radiance.engine import json_schema_grammar
from radiance.engine.json_schema_grammar import MAX_CACHED_TEXT, cache_small, json_schema_ebnf, served_schema_text
from radiance.engine.structured_output import GrammarBackend, StructuredOutput
from tests.engine.conftest import tiny_byte_bpe_tokenizer


def schema(description_chars: int) -> str:
    """A schema of a given size whose grammar does not depend on it (a description constrains nothing)."""
    return json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                       "description": "d" * description_chars})


BIG = schema(MAX_CACHED_TEXT)


def test_cache_small_caches_only_small_arguments():
    calls = []

    @cache_small(maxsize=4)
    def upper(text: str) -> str:
        calls.append(text)
        return text.upper()

    big = "b" * (MAX_CACHED_TEXT + 1)
    assert [upper("a"), upper("a"), upper(big), upper(big)] == ["A", "A", big.upper(), big.upper()]
    assert calls == ["a", big, big] and upper.cache_info().currsize == 1
    upper.cache_clear()
    assert upper.cache_info().currsize == 0


@pytest.mark.parametrize("cached", [json_schema_ebnf, served_schema_text])
def test_a_big_schema_is_not_cached_and_gives_what_the_cache_would(cached, monkeypatch):
    before = cached.cache_info().currsize
    uncached = cached(BIG)
    assert cached.cache_info().currsize == before
    monkeypatch.setattr(json_schema_grammar, "MAX_CACHED_TEXT", len(BIG))  # the same schema, now cached
    cached.cache_clear()
    assert cached(BIG) == uncached and cached.cache_info().currsize == 1


def test_a_big_schemas_grammar_is_the_small_ones():
    assert json_schema_ebnf(BIG) == json_schema_ebnf(schema(10))


def test_a_big_constraint_is_checked_uncached_and_held_as_a_small_one():
    backend = GrammarBackend(tiny_byte_bpe_tokenizer(), 320, [0])
    for spec in (StructuredOutput(json=schema(10)), StructuredOutput(json=BIG), StructuredOutput(regex="a" * 70000)):
        backend.compile(spec)
        backend.compile(spec)
    assert backend._check_once.cache_info().currsize == 1  # the small schema only
    for spec in (StructuredOutput(json=schema(10)), StructuredOutput(json=BIG)):
        state = backend.matcher(spec)
        assert state.matcher.accept_string('{"a": 12}') and state.matcher.is_completed()
