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
    """(tensors read, one warning per tensor holding NaN / inf values, or the read fault that stopped the pass)."""
    warnings, read = [], 0
    try:
        for name, item in ckpt.iter_weights(progress=progress):
            read += 1
            if isinstance(item, torch.Tensor):
                bad, culprit = nonfinite_count(item), name
            else:  # a linear in any format: its values as the model would multiply them
                bad = nonfinite_count(item.tensor if isinstance(item, DenseWeight) else dequantize(item))
                culprit = culprit_tensor(name, item) if bad else name
            if bad:
                warnings.append(f"{bad} NaN or inf value(s) (file {ckpt.file_of(culprit)}, tensor "
                                f"{ckpt.stored_name(culprit)})")
    except CheckpointError as exc:  # a scale or layout fault the reader refuses: nothing after it can be read
        warnings.append(f"reading stopped: {exc}")
    return read, warnings
