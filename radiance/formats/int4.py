"""Affine 4-bit weights (GGUF Q4_0 / Q4_1 / Q4_K): a code 0..15 per weight, a scale and an offset per 32 along K.

w = code * scale + offset, in fp32. With the scales and offsets GGUF stores (fp16 values, or Q4_K's fp16 x
6-bit products, exact in fp32) this is bit for bit what the `gguf` package's dequantization computes:
code * scale is exact, so the only rounding is the one addition both do.
"""

from __future__ import annotations

import torch

from radiance.formats._checks import check_matrix
from radiance.formats.e2m1 import unpack_e2m1

INT4_GROUP = 32  # weights per scale / offset along K


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] codes (low nibble = even k), fp32 [N, K/32] scale and offset -> fp32 [N, K]."""
    check_matrix(packed, "packed")
    n, k = packed.shape[0], packed.shape[1] * 2
    groups_shape = (n, k // INT4_GROUP)
    if k % INT4_GROUP or tuple(scale.shape) != groups_shape or tuple(offset.shape) != groups_shape:
        raise ValueError(f"int4 shapes disagree: packed {tuple(packed.shape)} needs K a multiple of {INT4_GROUP} and "
                         f"scale / offset {groups_shape}, got {tuple(scale.shape)} / {tuple(offset.shape)}")
    codes = unpack_e2m1(packed).float()
    groups = codes.view(n, k // INT4_GROUP, INT4_GROUP)
    return (groups * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)).view(n, k)
