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
