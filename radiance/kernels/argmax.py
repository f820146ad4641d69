"""Greedy token choice: the argmax of each logits row (Triton on CUDA and under the interpreter)."""

from __future__ import annotations

import torch

from radiance.kernels._triton import argmax as _argmax
from radiance.kernels.triton_support import next_pow2, triton_serves

CHUNK = 4096  # elements per program: a 128k vocabulary is 32 programs per row


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> int64 [B], the same indices as logits.argmax(-1)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows expects [B, V] logits, got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if not triton_serves(logits) or batch == 0 or vocab == 0 or logits.stride(1) != 1:
        return logits.argmax(-1)
    chunks = -(-vocab // CHUNK)
    vals = torch.empty((batch, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((batch, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _argmax.argmax_chunks_kernel[(chunks, batch)](logits, vals, idx, vocab, logits.stride(0), BLOCK=CHUNK,
                                                  num_warps=8)
    _argmax.argmax_merge_kernel[(batch,)](vals, idx, out, chunks, C_PAD=max(2, next_pow2(chunks)),
                                          num_warps=1)
    return out
