"""The caches of schema grammars and constraint checks hold a count of entries of any size (soak report F4): a
text over MAX_CACHED_TEXT is computed uncached instead, with the same result, and so is a result over
MAX_CACHED_RESULT (a small text can give a large one: review finding)."""

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


def test_cache_small_does_not_cache_a_large_result_of_a_small_argument():
    """The input's bound alone let maxsize small inputs pin maxsize large outputs (a small schema, a large grammar):
    a result over MAX_CACHED_RESULT is returned uncached, computed again on each call."""
    calls = []

    @cache_small(maxsize=4)
    def expand(text: str) -> str:
        calls.append(text)
        return text * (16 << 20) if text == "x" else text.upper()  # 1 character in, 16 MiB out

    big = expand("x")
    assert len(big) == 16 << 20 and expand.cache_info().currsize == 0
    assert expand("x") == big and calls == ["x", "x"]
    assert [expand("a"), expand("a")] == ["A", "A"] and calls == ["x", "x", "a"]
    assert expand.cache_info().currsize == 1


def test_cache_small_bounds_results_at_max_cached_result(monkeypatch):
    monkeypatch.setattr(json_schema_grammar, "MAX_CACHED_RESULT", 10)

    @cache_small(maxsize=8, text_size=lambda n: 0)
    def repeat(n: int):
        return {"ab": [b"c" * n, None, 3]}  # result_size: 2 + n

    assert [repeat(8), repeat(9)] == [{"ab": [b"c" * 8, None, 3]}, {"ab": [b"c" * 9, None, 3]}]
    assert repeat.cache_info().currsize == 1  # 10 is cached, 11 is not
    assert json_schema_grammar.result_size(None) == 0 and json_schema_grammar.result_size(("ab", "c")) == 3


@pytest.mark.parametrize("cached", [json_schema_ebnf, served_schema_text])
def test_a_large_grammar_or_served_schema_is_not_cached_and_gives_what_the_cache_would(cached, monkeypatch):
    small = schema(10)
    expected = cached.__wrapped__(small)
    monkeypatch.setattr(json_schema_grammar, "MAX_CACHED_RESULT", len(expected) - 1)  # its result is now too large
    cached.cache_clear()
    assert cached(small) == expected and cached(small) == expected
    assert cached.cache_info().currsize == 0
    monkeypatch.setattr(json_schema_grammar, "MAX_CACHED_RESULT", len(expected))
    assert cached(small) == expected and cached.cache_info().currsize == 1


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
