"""Load-time preparation of MXFP4 weights for the W4A8 kernels (DESIGN.md section 4).

The kernels expand e2m1 codes to e4m3 bytes with a byte-permute table and fold each 32-block's
exponent into the e4m3 exponent field, so the MMA runs on plain fp8 and only the epilogue scales:
  - per row n a reference exponent ref_n = max_block_e - 6; each block keeps s = e - ref_n in
    [-5, +6] (int8), exact in e4m3 because 6 * 2^6 = 384 < 448 and 0.5 * 2^-5 is still normal;
  - blocks with s < -5 would need e4m3 subnormals: their codes are re-rounded at load onto the
    s = -5 grid. Such blocks are counted (`underflow_blocks`) and reported, never silent;
  - codes keep the standard packing (low nibble = even k): the expansion works byte by byte, so it
    is correct whichever elements Triton groups into one inline-asm register.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radiance.formats._checks import check_mxfp4_pair
from radiance.formats import e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1
from radiance.formats.mxfp4 import E8M0_BIAS, MX_BLOCK, scale_by_pow2

SHIFT_MIN = -5  # lowest block shift whose e2m1 values stay normal in e4m3
SHIFT_MAX = 6  # 6 * 2^6 = 384 < 448 (e4m3 max)


@dataclass
class PreparedMxfp4:
    """An MXFP4 weight in the layout the W4A8 kernels read."""

    w_q: torch.Tensor  # uint8 [N, K/2], e2m1 codes (low nibble = even k)
    w_shift: torch.Tensor  # int8 [N, K/32], block exponent minus ref, in [-5, 6]
    w_ref: torch.Tensor  # int32 [N], per-row reference exponent
    w_scale: torch.Tensor  # fp32 [N], 2^ref (the epilogue factor)
    underflow_blocks: int  # nonzero blocks re-rounded because they sat below the exact window

    @property
    def shape(self) -> tuple[int, int]:
        return self.w_q.shape[0], self.w_q.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_q, self.w_shift, self.w_ref, self.w_scale))

    def to(self, device) -> "PreparedMxfp4":
        return PreparedMxfp4(self.w_q.to(device), self.w_shift.to(device), self.w_ref.to(device),
                             self.w_scale.to(device), self.underflow_blocks)


@torch.no_grad()
def prepare_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> PreparedMxfp4:
    """(packed uint8 [N, K/2], e8m0 [N, K/32]) -> PreparedMxfp4 on the same device."""
    check_mxfp4_pair(packed, scale_e8m0)
    n, half_k = packed.shape
    codes = unpack_e2m1(packed).reshape(n, -1, MX_BLOCK)
    e = scale_e8m0.to(torch.int32) - E8M0_BIAS
    nonzero = (codes & 7).amax(dim=-1) > 0
    # the reference follows the largest block that holds a nonzero value (all-zero blocks don't matter)
    e_live = torch.where(nonzero, e, torch.full_like(e, -(1 << 20)))
    row_max = e_live.amax(dim=-1) if e.shape[1] else torch.zeros(n, dtype=torch.int32, device=e.device)
    ref = torch.where(row_max > -(1 << 20), row_max - SHIFT_MAX, torch.zeros_like(row_max))
    shift = e - ref[:, None]
    shift = torch.where(nonzero, shift, torch.zeros_like(shift))
    low = shift < SHIFT_MIN
    underflow = int((low & nonzero).sum())
    if underflow:
        # re-round those blocks onto the s = -5 grid: value * 2^(s + 5) to e2m1, ties to even
        values = e2m1_to_float(codes)
        rerounded = round_to_e2m1(scale_by_pow2(values, (shift - SHIFT_MIN).clamp(min=-200)[..., None]))
        codes = torch.where(low[..., None], rerounded, codes)
        shift = torch.where(low, torch.full_like(shift, SHIFT_MIN), shift)
    w_scale = scale_by_pow2(torch.ones(n, dtype=torch.float32, device=packed.device), ref)
    return PreparedMxfp4(
        w_q=pack_e2m1(codes.reshape(n, 2 * half_k)).contiguous(),
        w_shift=shift.to(torch.int8).contiguous(),
        w_ref=ref.to(torch.int32).contiguous(),
        w_scale=w_scale.contiguous(),
        underflow_blocks=underflow,
    )


@torch.no_grad()
def dequantize_prepared(prepared: PreparedMxfp4) -> torch.Tensor:
    """The exact fp32 weight [N, K] the kernels multiply with (equals the MXFP4 weight when no block underflowed)."""
    n, k = prepared.shape
    values = e2m1_to_float(unpack_e2m1(prepared.w_q)).reshape(n, k // MX_BLOCK, MX_BLOCK)
    e = prepared.w_shift.to(torch.int32) + prepared.w_ref[:, None]
    return scale_by_pow2(values, e[..., None]).reshape(n, k)


@torch.no_grad()
def unprepare_mxfp4(prepared: PreparedMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """PreparedMxfp4 -> (packed, scale_e8m0) in the standard MXFP4 layout (lossless without underflow)."""
    e = prepared.w_shift.to(torch.int32) + prepared.w_ref[:, None]
    return prepared.w_q.clone(), (e.clamp(-127, 127) + E8M0_BIAS).to(torch.uint8)
