"""e2m1 (FP4) codes: 4 bits, sign in bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.

Two codes per byte, low nibble = even k. Code 8 (-0) is never written: -0 and negatives that
round to zero become code 0.
"""

from __future__ import annotations

import torch

from radiance.formats._checks import check_finite

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_uint8(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{name} must be uint8, got {t.dtype}")


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    _check_uint8(codes, "codes")
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15) -> packed bytes [..., K/2], low nibble = even k."""
    _check_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got {codes.shape[-1]}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("pack_e2m1: codes must be in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed bytes [..., K/2] -> uint8 codes [..., K]."""
    _check_uint8(packed, "packed")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def round_to_e2m1(x_scaled: torch.Tensor) -> torch.Tensor:
    """Round already-scaled float values to e2m1 codes: nearest, ties to the even code, clamp at 6.

    The e2m1 grid has spacing 0.5 below 2, 1 in [2, 4) and 2 from 4 on, so each range rounds with
    one half-to-even `torch.round` (which is what makes ties land on the even code). NaN and inf are
    refused: a NaN would otherwise become code 0 and an inf a silent 6.
    """
    check_finite(x_scaled, "x_scaled")
    a = x_scaled.abs().float()
    low = torch.round(2.0 * a)  # codes 0..4 for a < 2
    mid = torch.round(a) + 2.0  # codes 4..6 for 2 <= a < 4
    high = torch.clamp(torch.round(a * 0.5) + 4.0, max=7.0)  # codes 6..7 for a >= 4
    mag = torch.where(a < 2.0, low, torch.where(a < 4.0, mid, high)).to(torch.uint8)
    negative = (x_scaled < 0) & (mag != 0)  # -0 and tiny negatives stay code 0
    return mag | (negative.to(torch.uint8) << 3)
