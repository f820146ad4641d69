"""MXFP4 (OCP microscaling): e2m1 codes with one e8m0 exponent per 32 consecutive k.

Block exponent rules (DESIGN.md section 3), e unbiased, block scale 2^e:
  noclip  e = ceil(log2(amax / 6))    never clips
  ocp     e = floor(log2(amax)) - 2   the OCP spec's rule; clips values above 6 * 2^e
  mse     whichever of noclip and noclip - 1 gives the lower squared error (ties: noclip)
amax == 0 gives e = 0; e is clamped to [-127, 125] and stored biased (byte = e + 127). The top, 125,
saturates rather than overflows: 6 * 2^125 is the largest block whose every code decodes finite in fp32
(noclip's 126 would round values from 1.75 * 2^127 up to 2^128 = inf).
"""

from __future__ import annotations

import torch

from radiance.config import RULES  # one list for the formats and the config (which imports no torch)
from radiance.formats._checks import check_finite, check_k_multiple, check_matrix, check_mxfp4_pair
from radiance.formats.e2m1 import E2M1_MAX, e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1

MX_BLOCK = 32
E8M0_BIAS = 127
E_MIN, E_MAX = -127, 125  # quantizers' block exponents; e8m0 itself stores up to 127


def scale_by_pow2(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2^e exactly for integer e in [-254, 254], in two steps so no factor is subnormal."""
    e = e.to(torch.int32)
    half = torch.div(e, 2, rounding_mode="floor")
    return torch.ldexp(torch.ldexp(x, half), e - half)


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(v)) for positive finite float32 v (frexp: v = m * 2^E, m in [0.5, 1))."""
    _, exponent = torch.frexp(v)
    return exponent.to(torch.int32) - 1


def noclip_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with amax <= 6 * 2^e (exact, no float log)."""
    amax = amax.float()
    e = _floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - 2  # 6*2^(f-2) = 1.5*2^f >= 2^f
    # amax in [2^f, 2^(f+1)): 6 * 2^(f-2) = 1.5 * 2^f covers amax iff amax <= 1.5 * 2^f, else one more.
    too_small = amax > scale_by_pow2(torch.full_like(amax, E2M1_MAX), e)
    return e + too_small.to(torch.int32)


def ocp_exponent(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    return _floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - 2


def _quantize_blocks(blocks: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of fp32 blocks [..., 32] under exponents e [...], and each block's squared error in units of 4^e.

    The error is measured on the scaled values (x / 2^e - grid), exact power-of-two scaling: in x's own
    units the squares of huge blocks overflow fp32 and those of tiny blocks underflow to 0, which made
    `mse` compare inf with inf or 0 with 0. The differences are exact in fp32 and their squares in fp64.
    """
    scaled = scale_by_pow2(blocks, -e.unsqueeze(-1))
    codes = round_to_e2m1(scaled)
    error = scaled.sub_(e2m1_to_float(codes)).double().square_().sum(-1)  # in place: bounded transients
    return codes, error


def quantize_blocks(blocks: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased int32 exponents [...], codes [..., 32]) of fp32 blocks [..., 32] under `rule`."""
    if rule not in RULES:
        raise ValueError(f"unknown MXFP4 rule {rule!r}; expected one of {RULES}")
    amax = blocks.abs().amax(dim=-1)
    e = ocp_exponent(amax) if rule == "ocp" else noclip_exponent(amax)
    e = torch.clamp(torch.where(amax > 0, e, torch.zeros_like(e)), E_MIN, E_MAX)
    codes, error = _quantize_blocks(blocks, e)
    if rule == "mse":  # also try one exponent lower (clips the max, finer grid); keep the better block
        e_lo = torch.clamp(e - 1, E_MIN, E_MAX)
        codes_lo, error_lo = _quantize_blocks(blocks, e_lo)
        # error_lo is in units of 4^e_lo: a quarter of e's unit when e_lo = e - 1 (equal when clamped)
        error_lo = torch.where(e_lo < e, error_lo * 0.25, error_lo)
        lower = error_lo < error  # ties keep noclip
        e = torch.where(lower, e_lo, e)
        codes = torch.where(lower.unsqueeze(-1), codes_lo, codes)
    return e, codes


def quantize_mxfp4(w: torch.Tensor, rule: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed uint8 [N, K/2], scale uint8 e8m0 [N, K/32])."""
    check_matrix(w, "w")
    check_k_multiple(w, MX_BLOCK, "MXFP4")
    if rule not in RULES:
        raise ValueError(f"unknown MXFP4 rule {rule!r}; expected one of {RULES}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4 needs a floating-point weight, got {w.dtype}")
    check_finite(w, "w")
    n, k = w.shape
    blocks = w.float().reshape(n, k // MX_BLOCK, MX_BLOCK)
    e, codes = quantize_blocks(blocks, rule)
    return pack_e2m1(codes.reshape(n, k)), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed [N, K/2], e8m0 scale [N, K/32]) -> float32 [N, K]."""
    check_mxfp4_pair(packed, scale)
    n, half_k = packed.shape
    values = e2m1_to_float(unpack_e2m1(packed)).reshape(n, -1, MX_BLOCK)
    e = scale.to(torch.int32) - E8M0_BIAS
    return scale_by_pow2(values, e.unsqueeze(-1)).reshape(n, half_k * 2)
