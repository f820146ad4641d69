"""Token embedding and the output head (tied to the embedding or its own weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        try:
            return F.embedding(input_ids, self.weight)
        except IndexError:  # the CPU's "index out of range in self" names neither the id nor the vocabulary
            bad = self._first_out_of_range(input_ids)
            if bad is None:
                raise
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self.weight.shape[0]})") from None

    def _first_out_of_range(self, input_ids: torch.Tensor) -> int | None:
        bad = input_ids[(input_ids < 0) | (input_ids >= self.weight.shape[0])]
        return int(bad.flatten()[0]) if bad.numel() else None


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits in fp32. `linear` is a quantized linear module when the
    checkpoint ships one; otherwise the 16-bit `weight` (the embedding's when tied) is used."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied_to = tied_to
        self.linear: nn.Module | None = None
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits in fp32, or in the model's dtype with fp32=False (the engine's sampler converts only
        the rows that need it: a 128k-vocabulary copy per sequence is 22 us per step at batch 64)."""
        if self.linear is not None:
            logits = self.linear(hidden)
        else:
            logits = F.linear(hidden, self.tied_to.weight if self.tied_to is not None else self.weight)
        return logits.float() if fp32 else logits
