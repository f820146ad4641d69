"""The token embedding on the CPU: exact rows, and ids outside the vocabulary refused by name."""

from __future__ import annotations

import pytest
import torch

from radiance.layers.embedding import LMHead, VocabEmbedding


def embedding(vocab: int = 10, hidden: int = 4, dtype=torch.float32) -> VocabEmbedding:
    layer = VocabEmbedding(vocab, hidden)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(vocab * hidden, dtype=torch.float32).reshape(vocab, hidden))
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_rows_are_the_weight_rows(dtype, id_dtype):
    layer = embedding(dtype=dtype)
    ids = torch.tensor([[0, 9, 3], [3, 3, 1]], dtype=id_dtype)
    out = layer(ids)
    assert out.dtype == dtype and torch.equal(out, layer.weight[ids.long()])


@pytest.mark.parametrize("ids, bad", [([1, 10], 10), ([[2, 3], [11, 1]], 11), ([-1, 4], -1), ([4, 2**40], 2**40)])
def test_ids_outside_the_vocabulary_are_refused_by_name(ids, bad):
    """F.embedding said only "index out of range in self" (an IndexError), naming neither."""
    with pytest.raises(ValueError, match=rf"^token id {bad} is outside the vocabulary \(size 10\)$"):
        embedding()(torch.tensor(ids))


def test_tied_head_gives_fp32_logits_of_the_embedding():
    emb = embedding(dtype=torch.bfloat16)
    head = LMHead(10, 4, tied_to=emb)
    hidden = torch.randn(3, 4).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden, emb.weight).float())
    assert head(hidden, fp32=False).dtype == torch.bfloat16
