"""Structured output: a request's text held to a JSON schema, a regular expression, a list of choices or
an EBNF grammar by masking, before each sampling step, the tokens that would break it.

The grammar engine is xgrammar (what vLLM and SGLang use): it compiles a constraint against the
tokenizer's vocabulary once (cached), and per sequence a matcher tracks the tokens accepted so far and
fills a bitmask of the allowed next tokens (bit j of word i is token 32 i + j). The engine still queues
such sequences' next forward ahead (overlapped decode) but samples it only once the host has accepted
the token before it, which the next mask depends on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# compiled grammars kept per engine, least recently used dropped first (a JSON schema is ~0.1-1 MB)
GRAMMAR_CACHE_BYTES = 256 << 20


class StructuredOutputError(ValueError):
    """A constraint that cannot be served (it does not compile, or the model has no tokenizer): a 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint (vLLM's `structured_outputs` shape). JSON is generated compactly (one
    space after ':' and ',', no other whitespace), so a model cannot loop on whitespace."""

    json: str | None = None              # a JSON schema (text, or a dict, kept in its key order)
    json_object: bool = False            # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, exactly
    grammar: str | None = None           # EBNF (GBNF dialect), with a `root` rule

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError("choice needs at least one non-empty string")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * self.json_object
        if len(given) != 1:
            raise StructuredOutputError(f"give exactly one structured output constraint, got {given or 'none'}")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", text)


class GrammarBackend:
    """The compiler for one tokenizer and vocabulary (the logits' width, which may exceed the tokenizer's),
    with `stop_ids` as the tokens that end a completed constraint."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xgr  # imported on the first structured request: it loads a native library

        self._xgr = xgr
        try:  # without stop ids of the model's own, xgrammar takes the tokenizer's end-of-sequence token
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_ids) or None)
        except ValueError as exc:
            raise StructuredOutputError(f"structured output cannot use this model's tokenizer: {exc}") from exc
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        # fills a batch's masks on xgrammar's default thread count: inside JSON strings a 128k-vocabulary mask
        # takes ~0.14 ms per row (H200 host, 32 rows: 4.5 ms one by one, 2.2 ms so); cheap regex masks
        # lose to threads (0.6 -> 1.6 ms), but less than JSON gains (bench/RESULTS.md, eighteenth session)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled constraint (cached by its text); StructuredOutputError when it does not compile."""
        c = self.compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"invalid {spec.kind} constraint: {_reason(exc)}") from exc

    def matcher(self, spec: StructuredOutput) -> "GrammarState":
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self)


class GrammarState:
    """One sequence's progress through its constraint."""

    def __init__(self, matcher, backend: GrammarBackend):
        self.matcher = matcher
        self.backend = backend

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False if the constraint forbids it (the mask should have)."""
        return self.matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The constraint is complete and its stop token taken: the sequence ends here."""
        return self.matcher.is_terminated()


def fill_allowed_token_words(states: list[GrammarState], words) -> None:
    """Writes the allowed next tokens of each state into int32 words `words[:len(states)]` (host memory,
    [rows, ceil(V / 32)]); sampler.apply_token_masks reads them."""
    if len(states) == 1:
        states[0].matcher.fill_next_token_bitmask(words, 0)
    else:
        states[0].backend.batch.batch_fill_next_token_bitmask([state.matcher for state in states], words)
