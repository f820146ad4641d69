"""The checks of a request that the engine, `radiance generate` and the server share, each written once: prompt
size against the context, token ids against the vocabulary, text that is not UTF-8, logit_bias values, bad words
(tokenized here).

Each raises a RequestError naming the offending field: the engine raises it as is, the CLI prints it as one
line, the server answers a 400 with the field as `param` (in OpenAI's wording where OpenAI has one).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence, Sized
from numbers import Integral

from radiance.errors import RadianceError


class RequestError(RadianceError, ValueError):
    """A request that cannot be served as given; `field` names the offending field. A ValueError too, as the
    engine's request errors were before."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class SamplingParamsError(RequestError):
    """A sampling parameter out of range or of the wrong type; the message names it. A RadianceError, so the
    server answers a value its request schema let through (repetition_penalty Infinity) with a 400, not a 500."""


class ContextLengthError(RequestError):
    """The prompt, or the prompt and max_tokens, exceed the context. The numbers are kept so that the server can
    answer in OpenAI's wording (code context_length_exceeded). `max_tokens` is None when the prompt alone
    leaves no room."""

    def __init__(self, message: str, field: str, prompt_tokens: int, context: int, max_tokens: int | None):
        super().__init__(message, field)
        self.prompt_tokens = prompt_tokens
        self.context = context
        self.max_tokens = max_tokens


def check_not_empty(prompt: Sized, field: str) -> None:
    """A prompt (text, token ids or a list of prompts) with nothing in it."""
    if len(prompt) == 0:
        raise RequestError(f"{field} must not be empty", field)


def check_fits_context(prompt_tokens: int, context: int, prompt_field: str, max_tokens: int | None = None,
                       max_tokens_field: str = "max_tokens") -> None:
    """The prompt leaves room for output in a context of `context` tokens and, when `max_tokens` is given,
    prompt + max_tokens fit it: a silent cut at the context looked like the model's own stop."""
    check_not_empty(range(prompt_tokens), prompt_field)  # a range: the count as a Sized
    if prompt_tokens >= context:
        raise ContextLengthError(f"{prompt_field} has {prompt_tokens} tokens; this model serves at most {context} "
                                 "tokens including the output (max_model_len)",
                                 prompt_field, prompt_tokens, context, None)
    room = context - prompt_tokens
    if max_tokens is not None and max_tokens > room:
        tokens = f"{prompt_tokens} token" + ("s" if prompt_tokens != 1 else "")
        raise ContextLengthError(f"{max_tokens_field} {max_tokens} does not fit the model's context of {context} "
                                 f"tokens (max_model_len) after a prompt of {tokens}: use {max_tokens_field} {room} "
                                 "or less", max_tokens_field, prompt_tokens, context, max_tokens)


def truncate_prompt(token_ids: list[int], keep: int | None, context: int, max_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens, for the engine's LLM and the server alike: the last `keep` prompt tokens (left
    truncation, so a long chat keeps its newest turns), before the context check; -1 keeps as many as leave room for
    max_tokens (or one token). A `keep` past the room max_tokens leaves (vLLM's max_input_tokens) is refused."""
    if keep is None:
        return token_ids
    room = context - (max_tokens or 0)
    if keep == -1:
        keep = max(1, context - (max_tokens or 1))  # too little room: the context check says so
    elif keep > room > 0:  # no room at all: the context check names max_tokens instead
        limit = f"max_model_len {context}" + (f" - max_tokens {max_tokens}" if max_tokens else "")
        raise SamplingParamsError(f"truncate_prompt_tokens {keep} is more than the prompt may have ({limit} = {room})",
                                  "truncate_prompt_tokens")
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def check_token_ids(token_ids: Sequence, vocab_size: int, field: str) -> None:
    """Integer ids in [0, vocab_size): 2.5 passed a range check and failed inside the engine's step (stopping
    the async engine); an id outside the vocabulary indexed past the embedding."""
    bad = [t for t in token_ids if not isinstance(t, Integral) or isinstance(t, bool)]
    if bad:
        raise RequestError(f"{field} must be integer token ids, got {bad[0]!r}", field)
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{field} has token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}", field)


def lone_surrogate_at(text: str) -> int | None:
    """Where `text` holds a character UTF-8 cannot encode (a lone surrogate), or None. Python hands on bytes that
    are not UTF-8 (an argument, a pipe) as such, and JSON's "\\ud800" parses into one; tokenizers raise on it
    (TypeError, UnicodeEncodeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_utf8(text: str, field: str) -> None:
    """The CLI's wording: there a lone surrogate is a byte of the argument or pipe that is not UTF-8."""
    at = lone_surrogate_at(text)
    if at is not None:
        raise RequestError(f"{field} is not valid UTF-8 text (a byte at character {at} is not UTF-8)", field)


def check_logit_bias_value(token: int | str, bias: float) -> None:
    """OpenAI's range: -100 bans a token, 100 all but forces it (NaN compares false: refused too)."""
    if not -100.0 <= bias <= 100.0:
        raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                                  "logit_bias")


# a request's bad words, as token-id sequences (both spellings of each word count): vLLM's limits, so that the
# per-step matching on the host stays small
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 1024
# tokenized bad-word lists kept per tokenizer (the server's check, the engine's check and add_request each ask)
_BAD_WORDS_CACHED = 256
_bad_words_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_bad_words_lock = threading.Lock()


def tokenize_bad_words(words: Sequence[str], tokenizer,
                       max_token_chars: int | None = None) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of SamplingParams.bad_words: each word without its leading whitespace, encoded without
    special tokens, and again after one space (the word inside a text) when that gives as many tokens and another
    first token. A word of whitespace only (vLLM fails on it) is encoded as it is. RequestError naming bad_words
    for more than MAX_BAD_WORDS words or sequences, MAX_BAD_WORD_TOKENS tokens (as vLLM, tokenizing stops there;
    with `max_token_chars`, the longest token's text, words too long for that are refused before any tokenizing:
    128 words of 22 kB held the server's event loop 1.6 s), a word that is not UTF-8 or encodes to nothing.
    What is refused is not cached."""
    words = tuple(words)
    if len(words) > MAX_BAD_WORDS:  # each gives one sequence or two: refused before tokenizing
        raise RequestError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed", "bad_words")
    if max_token_chars:  # a token spans at most max_token_chars characters: fewer tokens than this are impossible
        chars = sum(len(word.lstrip() or word) for word in words)
        if chars > MAX_BAD_WORD_TOKENS * max_token_chars:
            raise RequestError(f"bad_words have {chars} characters: more than the {MAX_BAD_WORD_TOKENS} tokens "
                               "allowed", "bad_words")
    try:
        with _bad_words_lock:
            cache = _bad_words_cache.setdefault(tokenizer, {})
            hit = cache.get(words)
    except TypeError:  # a tokenizer without weak references or a hash: not cached
        cache, hit = None, None
    if hit is not None:
        return hit
    sequences: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        check_utf8(word, "bad_words")
        stripped = word.lstrip()
        first = tuple(tokenizer.encode(stripped or word, add_special_tokens=False))
        if not first:
            raise RequestError(f"bad_words[{i}] {word!r} encodes to no tokens", "bad_words")
        sequences.append(first)
        if stripped:
            spaced = tuple(tokenizer.encode(" " + stripped, add_special_tokens=False))
            if len(spaced) == len(first) and spaced[0] != first[0]:
                sequences.append(spaced)
        _check_bad_word_limits(sequences)  # as vLLM: the words after the limit are not tokenized
    result = tuple(sequences)
    if cache is not None:
        with _bad_words_lock:
            if len(cache) >= _BAD_WORDS_CACHED:
                cache.clear()
            cache[words] = result
    return result


def check_bad_words_token_ids(sequences: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Each id in the vocabulary (a tokenizer may count more ids than the logits have), within vLLM's limits."""
    check_token_ids([t for word in sequences for t in word], vocab_size, "bad_words")
    _check_bad_word_limits(sequences)


def _check_bad_word_limits(sequences: Sequence[Sequence[int]]) -> None:
    if len(sequences) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words give {len(sequences)} token sequences (each word once or twice: with and "
                           f"without a leading space); at most {MAX_BAD_WORDS} are allowed", "bad_words")
    total = sum(len(word) for word in sequences)
    if total > MAX_BAD_WORD_TOKENS:
        raise RequestError(f"bad_words tokenize to {total} tokens; at most {MAX_BAD_WORD_TOKENS} are allowed",
                           "bad_words")
