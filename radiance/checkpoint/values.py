"""`radiance inspect --values`: read every weight and name the ones a load would refuse (NaN / inf values, bad scales).

The rest of `inspect` reads headers only; this reads the whole checkpoint, as a load would, but lists every faulty
tensor instead of stopping at the first, and builds no model.
"""

from __future__ import annotations

import torch

from radiance.checkpoint.base import Checkpoint
from radiance.checkpoint.convert import culprit_tensor
from radiance.errors import CheckpointError
from radiance.formats import DenseWeight, dequantize
from radiance.formats._checks import nonfinite_count


def value_warnings(ckpt: Checkpoint, progress: bool = True) -> tuple[int, list[str]]:
    """(tensors read, one warning per tensor holding NaN / inf values or refused by the reader (a bad scale)).
    Entries are read one at a time where the checkpoint can (weight_reads), so a refused one is recorded and the
    pass goes on; otherwise a refusal ends the pass ("reading stopped: ...")."""
    warnings, read, tied = [], 0, {}
    reads = getattr(ckpt, "weight_reads", None)
    if reads is None:  # one stream: a refusal ends it, nothing after it can be read
        try:
            for name, item in ckpt.iter_weights(progress=progress):
                read += 1
                _check_values(ckpt, name, item, warnings, tied)
        except CheckpointError as exc:
            warnings.append(f"reading stopped: {exc}")
        return read, warnings + _tied_head_warnings(ckpt, tied)
    for read_entry in reads(progress=progress):
        try:
            for name, item in read_entry():
                read += 1
                _check_values(ckpt, name, item, warnings, tied)
        except CheckpointError as exc:  # a scale or layout fault the reader refuses: this entry only
            read += 1
            warnings.append(f"a load refuses it: {exc}")
    return read, warnings + _tied_head_warnings(ckpt, tied)


_TIED = ("model.embed_tokens.weight", "lm_head.weight")


def stored_head_differs(stored: torch.Tensor, embedding: torch.Tensor) -> bool:
    """Whether a tied model's stored lm_head.weight is not its embeddings (compared in the embeddings' dtype)."""
    return tuple(stored.shape) != tuple(embedding.shape) or not torch.equal(
        stored.to(embedding.device, embedding.dtype), embedding)


def _tied_head_warnings(ckpt: Checkpoint, tied: dict) -> list[str]:
    """tie_word_embeddings with a stored lm_head.weight that differs from the embeddings (the load warns: the
    embeddings serve as the head, as in vLLM, where transformers 5 serves the stored one)."""
    if len(tied) < 2 or not stored_head_differs(tied[_TIED[1]], tied[_TIED[0]]):
        return []
    return [f"config.json sets tie_word_embeddings, but an lm_head.weight differs from the embeddings (file "
            f"{ckpt.file_of('lm_head.weight')}): the embeddings serve as the head; if the flag is wrong, set "
            "\"tie_word_embeddings\": false"]


def _check_values(ckpt: Checkpoint, name: str, item: object, warnings: list[str], tied: dict) -> None:
    """A warning naming the stored tensor where `item` (one weight as read) holds NaN / inf values; the embeddings and
    a stored head kept in `tied` when config.json ties them."""
    if name in _TIED and isinstance(item, torch.Tensor) and ckpt.config.get("tie_word_embeddings"):
        tied[name] = item
    if isinstance(item, torch.Tensor):
        bad, culprit = nonfinite_count(item), name
    else:  # a linear in any format: its values as the model would multiply them
        try:
            bad = nonfinite_count(item.tensor if isinstance(item, DenseWeight) else dequantize(item))
        except ValueError as exc:  # scales the codec refuses (an MXFP4 scale past float32): as a load says it
            culprit = culprit_tensor(name, item)
            warnings.append(f"a load refuses it: {exc} (file {ckpt.file_of(culprit)}, tensor "
                            f"{ckpt.stored_name(culprit)})")
            return
        culprit = culprit_tensor(name, item) if bad else name
    if bad:
        warnings.append(f"{bad} NaN or inf value(s) (file {ckpt.file_of(culprit)}, tensor "
                        f"{ckpt.stored_name(culprit)})")
