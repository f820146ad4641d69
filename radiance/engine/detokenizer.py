"""Incremental detokenization and stop-string matching.

Decoding token by token breaks multi-byte characters and the leading-space rules of some tokenizers. Both
decoders follow vLLM's prefix_offset/read_offset scheme: a fast (Rust) tokenizer streams through
`tokenizers`' DecodeStream, primed with the prompt's last tokens (~2 us per token); any other tokenizer
decodes a short window each step (a few tokens of context + the new ones, ~15 us per token) and emits only
the text the new tokens added. Both hold back an incomplete character until it completes; bytes that stay
invalid are released once a real character could no longer be under way, and at the latest by `finish`.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6
_CHARACTER_TOKENS = 3  # an incomplete UTF-8 character has at most 3 bytes, so it lies in the last 3 tokens
_MAX_HELD_TOKENS = 8  # more tokens held back, with invalid bytes among them: release what can no longer change
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when earlier text changed


class _WindowDecoder:
    """Decodes the tokens since the last emission with the ones before it as context; works with any
    `decode(ids) -> str`. Keeps only that window of ids."""

    def __init__(self, decode, context_ids: list[int]):
        self.decode = decode
        self.ids = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        return self._advance()

    def flush(self) -> str:
        """The text held back at the end: an incomplete character as U+FFFD, as the full decode shows it."""
        prefix_text = self._text(self.read_offset)
        return self._commit(len(self.ids), self._text(len(self.ids))[len(prefix_text):])

    def _advance(self) -> str | None:
        prefix_text = self._text(self.read_offset)
        text = self._text(len(self.ids))
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            return self._commit(len(self.ids), text[len(prefix_text):])
        if len(self.ids) - self.read_offset > _MAX_HELD_TOKENS and _invalid_before_the_end(text[len(prefix_text):]):
            return self._release_invalid(prefix_text, text)
        return None

    def _release_invalid(self, prefix_text: str, text: str) -> str | None:
        """Releases the text before the last few tokens (where a character may still be under way): without
        this, a run of invalid bytes was never shown and each step decoded the whole run again."""
        for end in range(len(self.ids) - _CHARACTER_TOKENS, len(self.ids) - _MAX_HELD_TOKENS - 1, -1):
            head = self._text(end)
            # a cut that splits a character the later tokens complete is no prefix of the text, and the text's
            # last character may still change (when a token without bytes sits inside the split character)
            if len(prefix_text) < len(head) < len(text) and text.startswith(head):
                return self._commit(end, head[len(prefix_text):])
        return None

    def _text(self, end: int) -> str:
        return self.decode(self.ids[self.prefix_offset:end])

    def _commit(self, end: int, delta: str) -> str:
        """Marks ids up to `end` as emitted; the tokens of the previous emission become the context."""
        start = self.read_offset
        del self.ids[:start]
        self.prefix_offset, self.read_offset = 0, end - start
        return delta


def _invalid_before_the_end(pending_text: str) -> bool:
    """Whether held-back text shows invalid bytes before its last character. When only the last one is
    U+FFFD (tokens that each end inside a character, as byte-level BPEs split CJK), nothing is released."""
    return pending_text.endswith("\ufffd") and "\ufffd" in pending_text[:-1]


class _StreamDecoder(_WindowDecoder):
    """`tokenizers.decoders.DecodeStream` over a fast tokenizer's Rust backend, primed with the prompt's
    tail so the first token keeps the leading space a Metaspace decoder would strip at the start of text.
    It keeps the window's offsets too, and the window (over the same backend) takes over for good where
    DecodeStream fails: text before its read offset changing (byte-fallback tokens whose run turns invalid
    raise "Invalid prefix"), or invalid bytes held back too long."""

    def __init__(self, backend, decode, context_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        super().__init__(decode, context_ids)
        self.backend = backend
        self.stream = DecodeStream(list(self.ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        if self.stream is None:
            return super().step(token_id)
        self.ids.append(token_id)
        try:
            delta = self.stream.step(self.backend, token_id)
        except Exception as error:  # tokenizers raises a bare Exception
            if _INVALID_PREFIX not in str(error):
                raise
            self.stream = None
            return self._advance()
        if delta is not None:
            return self._commit(len(self.ids), delta)
        if len(self.ids) - self.read_offset > _MAX_HELD_TOKENS:
            delta = self._advance()
            if delta is not None:  # the stream's state no longer matches the emitted text
                self.stream = None
            return delta
        return None


def _decoder(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stream: bool):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if stream and backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        context = _context(decode, prompt_token_ids)
        # DecodeStream primed with a tail that ends inside a character hands that tail's text back with the first
        # token (a prompt of ids can stop mid-character); the window starts after its last whole character
        if not decode(context).endswith("\ufffd"):
            try:
                return _StreamDecoder(backend, decode, context, skip_special_tokens)
            except (ImportError, TypeError):  # tokenizers before 0.22 (no DecodeStream, or none primed with ids)
                pass

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return _WindowDecoder(decode, _context(decode, prompt_token_ids))


def _context(decode, prompt_token_ids: list[int]) -> list[int]:
    """The prompt's last tokens, decoded before the output's for its leading space: _CONTEXT_TOKENS, or up to 3
    more where those would start inside a character. A byte-fallback tokenizer (Llama 2) decodes a run of byte
    tokens all or nothing, so from mid-character the output's byte-token characters (CJK) came out U+FFFD."""
    start = max(0, len(prompt_token_ids) - _CONTEXT_TOKENS)
    for earlier in range(start, max(0, start - _CHARACTER_TOKENS) - 1, -1):
        if not decode(prompt_token_ids[earlier:]).startswith("\ufffd"):
            return list(prompt_token_ids[earlier:])
    return list(prompt_token_ids[start:])


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), stream: bool = True, include_stop: bool = False):
        """`tokenizer` None (a checkpoint without one, or SamplingParams(detokenize=False)): no decoding, the text
        stays "". `stream`: use DecodeStream when the tokenizer has a Rust backend (False: always the window).
        `include_stop`: the text is cut after the stop string that ends it, not before."""
        self.decoder = None if tokenizer is None else _decoder(tokenizer, prompt_token_ids, skip_special_tokens, stream)
        self.stop = stop
        self.include_stop = include_stop
        self.text = ""
        self.ended = False
        self.matched_stop: str | None = None  # the stop string that ended the text

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
        hits = [(at, -len(s), s) for s in self.stop
                if s and (at := self.text.find(s, max(0, old_length - len(s) + 1))) >= 0]
        if hits:
            at, minus_length, self.matched_stop = min(hits)  # of two starting at once, the longer
            self.text = self.text[:at - minus_length if self.include_stop else at]
            self.ended = True
            return True
        return False

    def finish(self) -> str:
        """The final text, once the output ends: bytes still held back (a character the output ended inside,
        invalid UTF-8) come out as U+FFFD, as the full decode shows them; without this they were lost. No stop
        string is looked for in them, and after a stop string nothing is added."""
        if self.decoder is not None and not self.ended:
            self.text += self.decoder.flush()
            self.ended = True  # a second call adds nothing
        return self.text
