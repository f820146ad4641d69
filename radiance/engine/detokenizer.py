"""Incremental detokenization and stop-string matching.

Decoding token by token breaks multi-byte characters and the leading-space rules of some tokenizers. A
fast (Rust) tokenizer streams through `tokenizers`' DecodeStream, primed with the prompt's last tokens
(~2 us per token); any other tokenizer decodes a short window each step (a few tokens of context + the
new ones, ~15 us per token) and emits only the text the new tokens added. Both hold back an incomplete
character until it completes.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6


class _WindowDecoder:
    """Decodes the last few tokens twice per step; works with any tokenizer that has `decode`."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class _StreamDecoder:
    """`tokenizers.decoders.DecodeStream` over a fast tokenizer's Rust backend, primed with the prompt's
    tail so the first token keeps the leading space a Metaspace decoder would strip at the start of text."""

    def __init__(self, backend, prompt_token_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.stream = DecodeStream(list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self.stream.step(self.backend, token_id)


def _decoder(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stream: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # DecodeStream primed with a tail that ends inside a character hands that tail's text back with the
    # first token (a prompt of ids can stop mid-character); the window starts after its last whole character
    if stream and backend is not None and not _ends_mid_character(backend, prompt_token_ids, skip_special_tokens):
        try:
            return _StreamDecoder(backend, prompt_token_ids, skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers before 0.22 (no DecodeStream, or none primed with ids)
            pass
    return _WindowDecoder(tokenizer, prompt_token_ids, skip_special_tokens)


def _ends_mid_character(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> bool:
    tail = list(prompt_token_ids[-_CONTEXT_TOKENS:])
    return backend.decode(tail, skip_special_tokens=skip_special_tokens).endswith("\ufffd")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), stream: bool = True, include_stop: bool = False):
        """`stream`: use DecodeStream when the tokenizer has a Rust backend (False: always the window).
        `include_stop`: the text is cut after the stop string that ends it, not before."""
        self.decoder = None if tokenizer is None else _decoder(tokenizer, prompt_token_ids, skip_special_tokens, stream)
        self.stop = stop
        self.include_stop = include_stop
        self.text = ""

    def visible_text(self) -> str:
        """Text safe to stream while generating: a tail that could still grow into a stop string is held
        back, so a client never sees characters that a later stop would have cut."""
        hold = 0
        for stop in () if self.include_stop else self.stop:  # a kept stop string is never taken back
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold] if hold else self.text

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one generated token; returns True when a stop string appeared (the text is cut before it, or
        after it with include_stop; the first one to start wins). With check_stop False (SamplingParams.min_tokens
        not reached) no stop string is looked for, and none that ends in this token's text counts later."""
        if self.decoder is None:
            return False
        delta = self.decoder.step(token_id)
        if not delta:
            return False
        old_length = len(self.text)
        self.text += delta
        if not check_stop:
            return False
        # a stop string counts where it ends in the new text (it may start in the old)
        hits = [(at, -len(s)) for s in self.stop
                if s and (at := self.text.find(s, max(0, old_length - len(s) + 1))) >= 0]
        if hits:
            at, minus_length = min(hits)  # of two starting at once, the longer
            self.text = self.text[:at - minus_length if self.include_stop else at]
            return True
        return False
