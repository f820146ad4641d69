"""The two-launch row argmax vs torch.argmax (run on CUDA, or on the CPU through the Triton
interpreter by test_triton_interpreter.py)."""

import pytest
import torch

from radiance.kernels.argmax import argmax_rows


@pytest.mark.parametrize("batch,vocab", [(1, 49152), (3, 128256), (2, 1000), (5, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch(device, batch, vocab, dtype):
    logits = (torch.randn(batch, vocab, device=device) * 4).to(dtype)
    # ties across chunk boundaries: the lowest index must win, as in torch
    top = logits.float().max() + 1
    logits[0, vocab - 1] = top
    logits[0, min(4097, vocab - 2)] = top
    if batch > 1:
        logits[1, :] = -float("inf")  # all -inf: index 0
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (batch,)
    assert torch.equal(got.cpu(), logits.float().argmax(-1).cpu())


def test_argmax_rows_nan_wins_like_torch(device):
    logits = torch.randn(2, 9000, device=device)
    logits[0, 8000] = float("inf")
    logits[0, 7000] = float("nan")
    logits[0, 8500] = float("nan")
    logits[1, 5] = float("inf")
    got = argmax_rows(logits)
    assert got.tolist() == logits.argmax(-1).tolist() == [7000, 5]


def test_argmax_rows_strided_rows(device):
    """Rows of a wider buffer (a stride larger than the vocabulary)."""
    wide = torch.randn(4, 6000, device=device)
    logits = wide[:, :5000]
    assert torch.equal(argmax_rows(logits).cpu(), logits.argmax(-1).cpu())
