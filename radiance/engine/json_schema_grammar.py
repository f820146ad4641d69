"""The grammar xgrammar 0.2.9 makes of a JSON schema, mended where it is wrong, and compiled.

xgrammar prints its grammars as EBNF, and radiance reads some back (a constraint after reasoning, tool calls) or
compiles them from text: `patched_ebnf` mends what its printer and its JSON-string rules get wrong;
`compile_json_schema` compiles a request's schema as json_schema_rules.served_schema rewrites it, through the mended
EBNF where that differs.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from typing import Any, Callable

from radiance.engine.json_schema_rules import served_schema

# the longest text (a schema, a constraint's) whose results are cached: the caches are bounded by entry count, so
# large schemas could pin ~1000x their size; a longer one is rare and redone each time (xgrammar's compile cache,
# bounded in bytes, still keeps its compiled grammar)
MAX_CACHED_TEXT = 64 << 10
# the largest result cached: a small text can give a large one (a schema's grammar is ~1-5x its size, more where
# served_schema expands it), so a cache's entries are bounded both ways, maxsize x (64 KiB + 256 KiB) at most; 4x
# the text's bound keeps the grammars of schemas under it cached in the usual case, a larger result is redone each
# time as a large text is
MAX_CACHED_RESULT = 4 * MAX_CACHED_TEXT


def result_size(value: Any) -> int:
    """The size a cached result holds, as MAX_CACHED_RESULT counts it: the length of text (str, bytes), 0 for None or
    a number, the sum over a tuple, list, set or dict's items, and sys.getsizeof for anything else."""
    if value is None or isinstance(value, (bool, int, float)):
        return 0
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, dict):
        return sum(result_size(k) + result_size(v) for k, v in value.items())
    if isinstance(value, (tuple, list, set, frozenset)):
        return sum(result_size(item) for item in value)
    return sys.getsizeof(value)


class _TooBigToCache(Exception):
    """Carries a result over MAX_CACHED_RESULT out through lru_cache, which caches no call that raises."""

    def __init__(self, result: Any):
        super().__init__()
        self.result = result


def cache_small(maxsize: int, text_size: Callable[[Any], int] = len,
                size_of_result: Callable[[Any], int] = result_size) -> Callable:
    """functools.lru_cache of a one-argument function, for arguments of text_size(arg) <= MAX_CACHED_TEXT only, and
    of those only results of size_of_result(result) <= MAX_CACHED_RESULT: others are computed uncached (the same
    result, computed again on each call). cache_info and cache_clear are the cache's."""
    def wrap(fn: Callable) -> Callable:
        def bounded(arg):
            result = fn(arg)
            if size_of_result(result) > MAX_CACHED_RESULT:
                raise _TooBigToCache(result)
            return result

        cached = functools.lru_cache(maxsize=maxsize)(bounded)

        @functools.wraps(fn)
        def call(arg):
            if text_size(arg) > MAX_CACHED_TEXT:
                return fn(arg)
            try:
                return cached(arg)
            except _TooBigToCache as too_big:
                return too_big.result

        call.cache_info, call.cache_clear = cached.cache_info, cached.cache_clear
        return call
    return wrap

# xgrammar's characters of a length-bounded JSON string (rules it names NAME_characters): any but '"', '\' and line
# ends, so raw control characters (not JSON) and no escapes; served instead as JSON allows them, one decoded
# character each (a \u escape of a surrogate half would count two for one character: left out), all through one
# shared rule (a rule each compiled 10x slower with 100 such strings)
_LENGTH_CHARACTERS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTER_RULE = "radiance_json_character"
_JSON_CHARACTER = (f'{_JSON_CHARACTER_RULE} ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" radiance_json_escape))\n'
                   'radiance_json_escape ::= (([\\"\\\\/bfnrt]) | ("u" (([0-9A-Ca-c] [0-9A-Fa-f] [0-9A-Fa-f] '
                   '[0-9A-Fa-f]) | ([Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f]) '
                   '| ([EFef] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f]))))')
# xgrammar prints a character below U+0100 as \xHH, which its parser reads on past two digits ([\xe9\xe8a-z] read
# back as \xe8a, "lower bound larger than upper bound"); \u00HH reads back as printed
_HEX_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9A-Fa-f]{2})")


def patched_ebnf(ebnf: str, json_strings: bool = True) -> str:
    """An EBNF grammar xgrammar printed, as it must be read back: its two-digit hex escapes written as four-digit
    ones and, for a grammar it built from JSON schemas (`json_strings`; not a request's own regex or EBNF, whose
    rules may look alike), its length-bounded JSON strings' characters made JSON's."""
    count = 0
    if json_strings:
        ebnf, count = _LENGTH_CHARACTERS.subn(lambda m: f"{m.group(1)} ::= (({_JSON_CHARACTER_RULE}))", ebnf)
    ebnf = _HEX_ESCAPE.sub(lambda m: f"{m.group(1)}\\u00{m.group(2)}", ebnf)
    return f"{ebnf}\n{_JSON_CHARACTER}\n" if count else ebnf


@cache_small(maxsize=256)
def served_schema_text(schema_text: str) -> str:
    """The JSON text of served_schema(schema); text that is not JSON unchanged (xgrammar's error names the place)."""
    try:
        return json.dumps(served_schema(json.loads(schema_text)))
    except (ValueError, RecursionError):
        return schema_text


@cache_small(maxsize=256)
def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF grammar that holds text to the JSON schema as served (JSON written compactly), patched_ebnf. Raises
    xgrammar's error for a schema it cannot read."""
    import xgrammar as xgr

    return patched_ebnf(str(xgr.Grammar.from_json_schema(served_schema_text(schema_text), any_whitespace=False)))


def compile_json_schema(compiler: Any, schema_text: str) -> Any:
    """The schema compiled by xgrammar's GrammarCompiler `compiler`: from its patched grammar where it has
    length-bounded strings, else by xgrammar's own JSON-schema compile (which reads no printed grammar back)."""
    ebnf = json_schema_ebnf(schema_text)
    if _JSON_CHARACTER_RULE in ebnf:
        return compiler.compile_grammar(ebnf)
    return compiler.compile_json_schema(served_schema_text(schema_text), any_whitespace=False)
