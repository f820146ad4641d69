"""Incremental detokenization and stop-string matching.

Decoding token by token breaks multi-byte characters and the leading-space rules of some tokenizers, so
each step decodes a short window (a few tokens of context + the new ones) and emits only the text that
the new tokens added, holding back an incomplete character (U+FFFD at the end) until it completes.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def visible_text(self) -> str:
        """Text safe to stream while generating: a tail that could still grow into a stop string is held
        back, so a client never sees characters that a later stop would have cut."""
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold] if hold else self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; returns True when a stop string appeared (text is cut before it)."""
        if self.tokenizer is None:
            return False
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        hits = [at for s in self.stop if s and (at := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False
