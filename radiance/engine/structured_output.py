"""Structured output: a request's text held to a JSON schema, a regular expression, a list of choices or
an EBNF grammar by masking, before each sampling step, the tokens that would break it.

The grammar engine is xgrammar (what vLLM and SGLang use): it compiles a constraint against the
tokenizer's vocabulary once (cached), and per sequence a matcher tracks the tokens accepted so far and
fills a bitmask of the allowed next tokens (bit j of word i is token 32 i + j). The engine still queues
such sequences' next forward ahead (overlapped decode) but samples it only once the host has accepted
the token before it, which the next mask depends on. What of a JSON schema xgrammar enforces, and how the rest
is refused or rewritten: json_schema_rules; the grammar made of it: json_schema_grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radiance.engine.json_schema_grammar import cache_small, compile_json_schema, json_schema_ebnf, patched_ebnf
from radiance.engine.json_schema_rules import MAX_ENUM_VALUES, check_json_schemas
from radiance.errors import StructuredOutputError

__all__ = ["StructuredOutput", "StructuredOutputsParams", "StructuredOutputError", "GrammarBackend", "GrammarState",
           "REASONING_BEFORE", "MAX_ENUM_VALUES", "check_syntax", "after_reasoning", "fill_allowed_token_words"]

# compiled grammars kept per engine, least recently used dropped first, by xgrammar's own count of their bytes. It
# counts about a fifth of what they hold: 32,000 distinct random schemas on SmolLM2's vocabulary were 206 MB to it
# and +987 MB of server RSS under a 256 MB limit (never reached); a 16 MB limit levels off at +160 MB
# (bench/RESULTS.md, forty-ninth session). A compile takes ~2 ms there: a miss is cheap.
GRAMMAR_CACHE_BYTES = 16 << 20


# gpt-oss's markers other than <|end|>: an analysis message leaves only by <|end|>, so the grammar and the
# harmony parser agree on where the final message starts
_HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|return|>",
                    "<|endoftext|>"]
_HARMONY_ANALYSIS = {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<|channel|>analysis<|message|>",
     "content": {"type": "any_text", "excludes": _HARMONY_MARKERS}, "end": "<|end|>"},
    {"type": "const_string", "value": "<|start|>assistant"}]}


def _think_block(begin: str, end: str = "</think>") -> dict:
    """A thinking block from `begin` on: free text up to its `end`, then the whitespace Qwen3 writes after it."""
    return {"type": "sequence", "elements": [
        {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": end},
        {"type": "regex", "pattern": r"\s{0,2}"}]}


# Structural-tag formats of the text before a constrained answer, by reasoning format (xgrammar's built-in model
# tags hold reasoning the same way: free text up to the block's end):
#   think: the rest of a <think> block the prompt opened, its end, and the whitespace Qwen3 writes after it;
#   optional_think: a whole <think> block the model may open as its first text (the prompt opened none: Qwen3's
#     hybrid template with thinking on, DeepSeek-R1-style models), or none, the answer then held from the start;
#   optional_mistral_think: the same with Magistral's [THINK] ... [/THINK] (control tokens, named by their text);
#   harmony: any analysis messages, then the final channel's header (the prompt ends with <|start|>assistant)
REASONING_BEFORE = {
    "think": _think_block(""),
    "optional_think": {"type": "optional", "content": _think_block("<think>")},
    "optional_mistral_think": {"type": "optional", "content": _think_block("[THINK]", "[/THINK]")},
    "harmony": {"type": "sequence", "elements": [
        {"type": "star", "content": _HARMONY_ANALYSIS},
        {"type": "or", "elements": [{"type": "const_string", "value": header} for header in
                                    ("<|channel|>final<|message|>", "<|channel|>final <|constrain|>json<|message|>")]},
    ]},
}


# vLLM's StructuredOutputsParams options refused, and why
UNSUPPORTED_OPTIONS = {
    "whitespace_pattern": "JSON is written with one space after ':' and ',' and no other whitespace (as "
                          "disable_any_whitespace=True asks); another whitespace pattern cannot be set",
    # a structural tag holds JSON schemas of its own, which would skip the checks of json_schema_rules (what xgrammar
    # compiles for minutes, or compiles but does not enforce)
    "structural_tag": "use json, regex, choice, grammar or json_object (a structural tag's schemas could not be "
                      "checked as a json constraint's are)",
}


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint (vLLM's `structured_outputs` shape). JSON is generated compactly (one
    space after ':' and ',', no other whitespace), so a model cannot loop on whitespace."""

    json: str | None = None              # a JSON schema (text, or a dict, kept in its key order)
    json_object: bool | None = False     # any JSON object (None, vLLM's default, is False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, exactly
    grammar: str | None = None           # EBNF (GBNF dialect), with a `root` rule
    # set by the server, never by a request: the reasoning (REASONING_BEFORE) that runs free before the text held
    # to the constraint, so the constraint holds the answer, not the model's thinking
    after_reasoning: str | None = None
    # vLLM's options, taken where the grammar already does what they ask (either value: vLLM's own xgrammar backend
    # reads these from its engine config, not the request): JSON is written without free whitespace (what
    # disable_any_whitespace=True asks), and an object schema without additionalProperties allows no other
    # properties (xgrammar's strict mode; what disable_additional_properties=True asks). disable_fallback (older
    # vLLM's): there is no other backend to fall back to
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    # vLLM's options that cannot be honoured here: refused, not ignored (UNSUPPORTED_OPTIONS says why)
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        if self.json_object is None:
            object.__setattr__(self, "json_object", False)
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise StructuredOutputError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, why in UNSUPPORTED_OPTIONS.items():
            if getattr(self, name) is not None:
                raise StructuredOutputError(f"{name} is not supported: {why}")
        if self.after_reasoning is not None and self.after_reasoning not in REASONING_BEFORE:
            raise StructuredOutputError(f"unknown reasoning format {self.after_reasoning!r}")
        if isinstance(self.json, dict):
            try:
                object.__setattr__(self, "json", json.dumps(self.json))
            except RecursionError:  # a RecursionError was a 500
                raise StructuredOutputError("the JSON schema is nested too deeply") from None
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


# vLLM's name (SamplingParams(structured_outputs=StructuredOutputsParams(json=...))): the same fields by keyword
# (json, regex, choice, grammar, json_object and vLLM's options: whitespace_pattern and structural_tag refused)
StructuredOutputsParams = StructuredOutput


def _check_servable(spec: StructuredOutput) -> None:
    """What xgrammar would compile but not enforce, or compile too slowly (check_json_schemas)."""
    if spec.choice is not None and len(spec.choice) > MAX_ENUM_VALUES:
        raise StructuredOutputError(f"invalid choice constraint: {len(spec.choice)} choices, more than the "
                                    f"{MAX_ENUM_VALUES} allowed")
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except ValueError:
            return  # xgrammar's parse error names the place
        except RecursionError:
            raise StructuredOutputError("invalid json constraint: the schema is nested too deeply") from None
        check_json_schemas({"#": schema}, "invalid json constraint")


def check_syntax(spec: StructuredOutput) -> None:
    """What needs no tokenizer: the constraint parses and is servable. `radiance generate` checks this before the
    model loads (a typo in a regex is one line at once, not after minutes of loading)."""
    import xgrammar as xgr

    _check_servable(spec)
    try:
        if spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
        else:
            _grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(f"invalid {spec.kind} constraint: {_reason(exc)}") from exc


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
        # a request compiles its constraint up to three times (the server's check, add_request's, its matcher's):
        # xgrammar caches the compile, this the checks around it (only passes are cached: a failure raises)
        self._check_once = cache_small(maxsize=1024, text_size=_spec_text_size)(self._check)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled constraint (cached by its text); StructuredOutputError when it does not compile, could
        not be enforced or held to no text at all."""
        try:
            self._check_once(spec)
        except TypeError:  # an unhashable spec (json given as a list): checked uncached, as before
            self._check(spec)
        return self._compile(spec)

    def _check(self, spec: StructuredOutput) -> None:
        _check_servable(spec)  # before compiling: it refuses what would compile for minutes
        self._check_admits_text(self._compile(spec), spec)

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self.compiler
        try:
            if spec.after_reasoning is not None:
                return c.compile_grammar(after_reasoning(_grammar(spec), spec.after_reasoning))
            if spec.json is not None:
                return compile_json_schema(c, spec.json)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar(_choice_ebnf(spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"invalid {spec.kind} constraint: {_reason(exc)}") from exc

    def _check_admits_text(self, compiled: Any, spec: StructuredOutput) -> None:
        """A grammar that allows no first token (`root ::= root`) would end its request at once with a token it
        refused: the request is answered instead."""
        first = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first)
        if not first.any():
            raise StructuredOutputError(f"invalid {spec.kind} constraint: no text satisfies it")

    def matcher(self, spec: StructuredOutput) -> "GrammarState":
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self)


def _spec_text_size(spec: StructuredOutput) -> int:
    """The length of the text a spec holds (what its cache entry keeps); 0 for json not text (unhashable: the
    cache refuses it)."""
    texts = (spec.json, spec.regex, spec.grammar, *(spec.choice or ()))
    return sum(len(text) for text in texts if isinstance(text, str))


def _choice_ebnf(choice: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choice)


def _grammar(spec: StructuredOutput) -> str:
    """The constraint alone as EBNF (what _compile compiles directly), to be placed after the reasoning."""
    import xgrammar as xgr

    if spec.json is not None:
        return json_schema_ebnf(spec.json)
    if spec.json_object:
        return str(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
    if spec.regex is not None:
        return patched_ebnf(str(xgr.Grammar.from_regex(spec.regex)), json_strings=False)
    return _choice_ebnf(spec.choice) if spec.choice is not None else spec.grammar


def after_reasoning(grammar: str, reasoning: str) -> str:
    """EBNF of the model's reasoning in format `reasoning` (REASONING_BEFORE), free, then text held to `grammar`."""
    import xgrammar as xgr

    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        REASONING_BEFORE[reasoning], {"type": "grammar", "grammar": grammar}]}}
    return patched_ebnf(str(xgr.Grammar.from_structural_tag(json.dumps(tag))), json_strings=False)


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
