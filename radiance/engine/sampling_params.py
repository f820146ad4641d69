"""Per-request generation settings (the vLLM shape users know)."""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum, IntEnum
from numbers import Integral, Real

import numpy

# SamplingParamsError lives with the request checks (one of them raises it); importable from here as before
from radiance.engine.request_checks import (RequestError, SamplingParamsError, check_bad_words_token_ids,
                                            check_logit_bias_value, tokenize_bad_words)
from radiance.engine.structured_output import StructuredOutput
from radiance.layers.sampler import GREEDY_BELOW

logger = logging.getLogger(__name__)

# vLLM's bounds: a temperature in (0, 0.01) is raised to 0.01 (smaller ones overflow the scaled logits), and one
# above 2 is refused
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0


class RequestOutputKind(Enum):
    """vLLM's: what a streaming engine hands back per step. LLM.generate returns finished outputs only
    (FINAL_ONLY, as vLLM's LLM forces), so SamplingParams takes any value and ignores it."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(IntEnum):
    """vLLM's SamplingParams.sampling_type."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


# frozen only so that __init__ sets the fields directly (no checked __setattr__ per field): the __setattr__ set
# after the class makes assignment work, checked
@dataclass(frozen=True)
class SamplingParams:
    """vLLM's SamplingParams. Mutable as vLLM's (`sp.max_tokens = 64`): an assigned value is checked and normalised
    as the constructor's (a bad one raises the same SamplingParamsError and leaves the object as it was). The rules
    between fields (greedy needs n = 1, min_tokens <= max_tokens, best_of, stop strings need detokenize) wait for
    the params' use (check_across_fields: LLM.generate, the engine's add_request), so assignments go in any order
    (n = 2 at temperature 0 is refused there, with the constructor's message). The engine takes its own copy of the
    parameters of each request it is given."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0     # 0 = greedy; in [0, 2], and one in (0, 0.01) is raised to 0.01 (vLLM's)
    top_p: float = 1.0
    top_k: int = -1              # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None      # per-request generator: same seed, same prompt -> same tokens
    stop: tuple[str, ...] | str = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # number of top alternatives to return with each sampled token; -1 (vLLM's): the whole vocabulary, which
    # LLM.generate turns into the vocabulary's size (its max_logprobs must allow it; the engine takes a count)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (no prefix cache reuse)
    skip_special_tokens: bool = True
    # applied to the logits before greedy choice or sampling, in this order (as vLLM does); logprobs
    # stay those of the model's own distribution
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()  # token id -> added; -100 bans
    repetition_penalty: float = 1.0  # tokens in prompt or output: logit / p if positive, else * p
    frequency_penalty: float = 0.0   # minus p x the token's count in the output
    presence_penalty: float = 0.0    # minus p once the token is in the output
    # the output must match this JSON schema / regex / choice / grammar (tokens that would break it are masked)
    structured_output: StructuredOutput | None = None
    # vLLM's: the stop string (or stop_token_ids token) that ended the output stays at the end of its text
    include_stop_str_in_output: bool = False
    # vLLM's: EOS and the stop_token_ids are banned (their logits -inf) until the output has this many tokens,
    # and a stop string counts only where it ends after them
    min_tokens: int = 0
    # vLLM v0's "n best of best_of samples"; v1 dropped it, and so does this engine: only unset or n is accepted
    best_of: int | None = None
    # vLLM's: only these token ids may be chosen (every other logit -inf, before the bias); None: any
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (None: the unsalted pool),
    # so a tenant cannot time another's cached prompt
    cache_salt: str | None = None
    # vLLM's: words never to write. Each is tokenized as vLLM does (bad_words_token_ids): a one-token word is
    # banned outright; a longer one bans its last token wherever the output so far ends with its other tokens
    bad_words: tuple[str, ...] = ()
    # the token-id sequences of bad_words (vLLM's property of this name): None until the engine tokenizes
    # bad_words with the model's tokenizer; given, they are used as they are (e.g. a model without a tokenizer)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # vLLM's: False leaves each output's text empty (its token_ids only) and spares the engine the decoding; stop
    # strings need the text, so they are refused then
    detokenize: bool = True
    # vLLM's: keep only the last k prompt tokens (left truncation) before the context check; -1: as many as
    # leave room for max_tokens. Applied by LLM.generate (the server reads the request field of this name)
    truncate_prompt_tokens: int | None = None
    # vLLM's: the tokenizer decodes special tokens without spaces between them either way (as vLLM's detokenizer
    # of fast tokenizers, which ignores this), so both values are taken
    spaces_between_special_tokens: bool = True
    # vLLM's (a RequestOutputKind): taken and ignored, LLM.generate returning finished outputs only
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self._check_and_normalise(across_fields=True)

    def check_across_fields(self) -> None:
        """The rules between fields (ACROSS_FIELDS), which assignment leaves to the params' use: the constructor's
        SamplingParamsError (and message) where the fields as assigned break one."""
        for rule in ACROSS_FIELDS:
            self._check_rule(rule)

    def _check_rule(self, rule: str) -> None:
        holds, message, field = ACROSS_FIELDS[rule]
        if not holds(self):
            raise SamplingParamsError(message(self), field)

    def _check_and_normalise(self, across_fields: bool) -> None:
        """The constructor's checks and normalisations, in place (object.__setattr__: frozen). Without
        `across_fields` (an assignment, on a copy) the rules between fields are left out: with n = 2,
        `sp.temperature = 0` then `sp.n = 1` was refused at the first step, as vLLM checks nothing on
        assignment."""
        def check(cond, msg, field=None):
            if not cond:
                raise SamplingParamsError(msg, field)

        def check_across(rule):
            if across_fields:
                self._check_rule(rule)

        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: True asks for one, False (not None) for none beside
            if isinstance(getattr(self, name), bool):  # the sampled token
                object.__setattr__(self, name, int(getattr(self, name)))

        # types first: a float seed or a None stop string failed later, inside the engine's loop
        # (a bool is an Integral, but True for n or temperature is a mistake, and "no" for ignore_eos was true)
        for name in ("n", "max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens", "best_of",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            optional = name not in ("n", "top_k", "min_tokens")
            check(isinstance(value, Integral) and not isinstance(value, bool) or optional and value is None,
                  f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)  # a string or None failed below as a TypeError
            check(isinstance(value, Real) and not isinstance(value, bool), f"{name} must be a number, got {value!r}")
        # numpy's bools and 0 / 1 pass
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            value = getattr(self, name)
            check(isinstance(value, (Integral, numpy.bool_)) and value in (True, False),
                  f"{name} must be true or false, got {value!r}")
            object.__setattr__(self, name, bool(value))
        check(isinstance(self.stop, str) or _is_sequence(self.stop, str),
              f"stop must be a string or a list of strings, got {self.stop!r}")
        # True was taken as token 1, and a negative id matched nothing: the request ran on past its stop
        check(_is_sequence(self.stop_token_ids, Integral) and not any(isinstance(t, bool) or t < 0
                                                                     for t in self.stop_token_ids or ()),
              f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        # vLLM de-duplicates them (and bad_words), keeping the first of each
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(int(t) for t in self.stop_token_ids or ())))
        # vLLM refuses it too: it would end every output at once (it matched nothing here, silently)
        check(all(self.stop), f"stop strings must not be empty, got stop {list(self.stop)!r}")
        check(self.allowed_token_ids is None or _is_sequence(self.allowed_token_ids, Integral)
              and not any(isinstance(t, bool) for t in self.allowed_token_ids),
              f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}")
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids})))
        check(self.cache_salt is None or isinstance(self.cache_salt, str) and self.cache_salt != "",
              f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        check(_is_sequence(self.bad_words, str), f"bad_words must be a list of strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(self.bad_words or ())))
        check(all(self.bad_words), "bad_words must be non-empty strings")
        ids = self.bad_words_token_ids
        check(_is_sequence(ids, (list, tuple)) and all(_is_sequence(word, Integral) and word is not None
                                                      and not isinstance(word, (set, frozenset))
                                                      and not any(isinstance(t, bool) for t in word)
                                                      for word in ids or ()),
              f"bad_words_token_ids must be a list of lists of integers, got {ids!r}")
        if ids is not None:
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(int(t) for t in word) for word in ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))

        check(self.n >= 1, f"n must be at least 1, got {self.n}")
        if self.seed == -1:  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
              or self.truncate_prompt_tokens >= 1,
              f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        check_across("stop needs detokenize")
        check_across("best_of")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        check_across("min_tokens")
        # NaN compares false: "must be non-negative, got nan" said the wrong thing
        check(not math.isnan(self.temperature), "temperature must be a number, got nan")
        check(self.temperature >= 0.0, f"temperature must be in [0, 2], got {self.temperature}")
        # an infinite temperature or penalty turns a masked (-inf) or zero logit into NaN
        for name in ("temperature", "repetition_penalty"):
            check(math.isfinite(getattr(self, name)), f"{name} must be finite, got {getattr(self, name)}")
        check(self.temperature <= MAX_TEMPERATURE, f"temperature must be in [0, 2], got {self.temperature}",
              "temperature")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors (nan or inf); it is "
                           "raised to %s (as vLLM does)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        check_across("greedy needs n 1")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or non-negative, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or value >= -1,
                  f"{name} must be non-negative or -1 (the whole vocabulary), got {value}")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            check(token >= 0, f"logit_bias token ids must be non-negative, got {token}")
            check_logit_bias_value(token, bias)
        if self.allowed_token_ids is not None:  # an empty list would leave nothing to choose
            check(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty")
            check(self.allowed_token_ids[0] >= 0,
                  f"allowed_token_ids must be non-negative, got {self.allowed_token_ids[0]}")
        for word in self.bad_words_token_ids or ():
            check(len(word) > 0, "bad_words_token_ids must not hold an empty list")
            check(min(word) >= 0, f"bad_words_token_ids must be non-negative, got {min(word)}")

    def clone(self) -> "SamplingParams":
        """vLLM's deep copy: an independent, mutable copy (every field holds an immutable value, so a shallow
        copy is as deep). Not checked, as vLLM's is not: the params may be between assignments."""
        return copy.copy(self)

    @property
    def structured_outputs(self) -> StructuredOutput | None:
        """vLLM's name of structured_output."""
        return self.structured_output

    @property
    def sampling_type(self) -> SamplingType:
        """vLLM's: greedy, sampled with a seed, or sampled."""
        if self.greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        """vLLM's: the stop_token_ids (vLLM's engine adds the EOS ids to its copy; radiance's engine keeps them
        apart, LLMEngine.eos_token_ids)."""
        return set(self.stop_token_ids)

    def for_choice(self, choice: int) -> "SamplingParams":
        """The one-sequence parameters of choice `choice` of an n > 1 request: n=1, the seed advanced by the
        choice (seed + choice; the engine serves one sequence per request, LLM.generate and the server expand n)."""
        return replace(self, n=1, best_of=None, seed=choice_seed(self.seed, choice))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """Whether a penalty looks at the tokens already there."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (bias, penalties, allowed tokens, bad words or a structured
        output)."""
        return (bool(self.logit_bias) or self.penalizes or self.structured_output is not None
                or self.allowed_token_ids is not None or self.has_bad_words)

    @property
    def has_bad_words(self) -> bool:
        return bool(self.bad_words) or bool(self.bad_words_token_ids)


# the rules between fields: the constructor checks each in its place, check_across_fields all, assignment none (the
# fields may be assigned in any order, as vLLM's). rule -> (holds, its message, the field it names)
ACROSS_FIELDS = {
    # vLLM's rule: a stop string is looked for in the text
    "stop needs detokenize": (lambda p: p.detokenize or not p.stop,
                              lambda p: f"stop strings need detokenize=True (got stop {list(p.stop)!r} with "
                                        "detokenize=False); use stop_token_ids", None),
    "best_of": (lambda p: p.best_of is None or p.best_of == p.n,
                lambda p: f"best_of is not supported (got {p.best_of} with n {p.n}; vLLM v1 removed it too): leave it "
                          "unset, or ask for n samples with logprobs and pick by cumulative_logprob", None),
    "min_tokens": (lambda p: p.max_tokens is None or p.min_tokens <= p.max_tokens,
                   lambda p: f"min_tokens must be at most max_tokens, got min_tokens {p.min_tokens} > max_tokens "
                             f"{p.max_tokens}", None),
    # vLLM's rule: greedy choices would all be the same
    "greedy needs n 1": (lambda p: p.n == 1 or not p.greedy,
                         lambda p: f"n must be 1 when using greedy sampling, got {p.n}", "n"),
}
# vLLM's SamplingParams fields radiance takes under another name or not at all: what to write instead
VLLM_FIELD_HINTS = {
    "guided_decoding": "use structured_outputs= (or structured_output=) StructuredOutputsParams(json=..., regex=..., "
                       "choice=..., grammar=...) (from radiance import StructuredOutputsParams)",
    "logits_processors": "custom logits processors are not supported",
}
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
# vLLM's field names of radiance's fields: the constructor and assignment take them
_FIELD_ALIASES = {"structured_outputs": "structured_output"}


def _unknown_field_message(name: str) -> str:
    hint = VLLM_FIELD_HINTS.get(name, "not a sampling parameter radiance knows")
    return f"SamplingParams got an unknown field {name!r}: {hint}"


def _reject_unknown_fields(init):
    """The dataclass __init__, raising a SamplingParamsError that names an unknown keyword (a bare TypeError
    before) and says what radiance takes instead of vLLM's fields it lacks; vLLM's names (_FIELD_ALIASES) are
    taken for radiance's."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for alias, name in _FIELD_ALIASES.items():
            if alias in kwargs:  # vLLM's name wins: dataclasses.replace(p, structured_outputs=x) passes both
                kwargs[name] = kwargs.pop(alias)
        for name in kwargs:
            if name not in _FIELD_NAMES:
                raise SamplingParamsError(_unknown_field_message(name), name)
        init(self, *args, **kwargs)
    return checked_init


SamplingParams.__init__ = _reject_unknown_fields(SamplingParams.__init__)  # type: ignore[method-assign]


def _checked_setattr(self: SamplingParams, name: str, value) -> None:
    """vLLM's `sp.max_tokens = 64`, checked and normalised as the constructor does, on a copy: a bad value raises
    the constructor's SamplingParamsError and leaves the object as it was. The rules between fields wait for the
    params' use (check_across_fields), as the fields may be assigned in any order."""
    name = _FIELD_ALIASES.get(name, name)
    if name not in _FIELD_NAMES:  # a typo (sp.temprature = 0) was kept and never read
        raise SamplingParamsError(_unknown_field_message(name), name)
    checked = copy.copy(self)
    object.__setattr__(checked, name, value)
    checked._check_and_normalise(across_fields=False)
    for f in fields(self):
        object.__setattr__(self, f.name, getattr(checked, f.name))


SamplingParams.__setattr__ = _checked_setattr  # type: ignore[method-assign, assignment]
SamplingParams.__hash__ = None  # type: ignore[assignment]  # mutable, as vLLM's: not hashable


def _logit_bias_pairs(logit_bias) -> tuple[tuple[int, float], ...]:
    """logit_bias (a mapping or (id, bias) pairs) as sorted (int, float) pairs. A key must read as an integer
    (OpenAI's JSON gives "50256") and a value as a number: int("x") / float("x") failed unnamed before."""
    pairs = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias or ()
    try:
        out = []
        for token, bias in pairs:
            if isinstance(token, (bool, float)) or isinstance(bias, (bool, str)):
                raise ValueError
            out.append((int(token), float(bias)))
    except (TypeError, ValueError):
        raise SamplingParamsError(f"logit_bias must map token ids to numbers, got {logit_bias!r}",
                                  "logit_bias") from None
    return tuple(sorted(out))


def _is_sequence(value, kind) -> bool:
    """None, or a list / tuple / set of `kind` items."""
    return value is None or isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, kind) for v in value)


def tokenized_bad_words(params: SamplingParams, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token-id sequences the sampler bans for `params` (its bad_words_token_ids, or its bad_words tokenized
    with `tokenizer`), checked against the vocabulary; () without bad words. A RequestError names bad_words."""
    ids = params.bad_words_token_ids
    if not ids and params.bad_words:  # an empty list given beside the words: the words count
        if tokenizer is None:
            raise RequestError("bad_words need the model's tokenizer, and this checkpoint has none: give "
                               "bad_words_token_ids", "bad_words")
        ids = tokenize_bad_words(params.bad_words, tokenizer)
    check_bad_words_token_ids(ids or (), vocab_size)
    return ids or ()


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a seeded n > 1 request (None stays None): choices draw apart, reproducibly."""
    return None if seed is None else seed + choice


def generator_seed(seed: int) -> int:
    """The torch generator seed of a request's `seed` (any int, wrapped into 64 bits): splitmix64's finalizer,
    a one-to-one mix, so the low 32 bits depend on all 64. torch's CPU generator (mt19937) keeps only the low 32
    bits of its seed: seeds -1 and 2**63 - 1, or 1 and 2**32 + 1, drew the same tokens."""
    z = seed % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)
