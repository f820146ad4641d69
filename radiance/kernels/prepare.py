"""Load-time preparation of MXFP4 weights for the W4A8 kernels (DESIGN.md section 4).

The kernels expand e2m1 codes to e4m3 bytes with a byte-permute table and fold each 32-block's
exponent into the e4m3 exponent field, so the MMA runs on plain fp8 and only the epilogue scales:
  - per row n a reference exponent ref_n = max_block_e - 6; each block keeps s = e - ref_n in
    [-5, +6] (int8), exact in e4m3 because 6 * 2^6 = 384 < 448 and 0.5 * 2^-5 is still normal;
  - blocks with s < -5 would need e4m3 subnormals: their codes are re-rounded at load onto the
    s = -5 grid. Such blocks are counted (`underflow_blocks`) and reported, never silent;
  - codes are regrouped into int32 "kernel words" of 8 consecutive k (`pack_kernel_words`), laid out
    so that two prmt table lookups and a few logic ops turn one word into 8 e4m3 bytes;
  - block shifts are stored group-major, [K/128, N, 4]: the 4 shifts of one row's 128-k group are one
    32-bit word, next to the same group of the neighbouring rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radiance.formats._checks import check_mxfp4_pair
from radiance.formats import e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1
from radiance.formats.mxfp4 import E8M0_BIAS, MX_BLOCK, scale_by_pow2

SHIFT_MIN = -5  # lowest block shift whose e2m1 values stay normal in e4m3
SHIFT_MAX = 6  # 6 * 2^6 = 384 < 448 (e4m3 max)
WORD_K = 8  # e2m1 codes per kernel word
GROUP_K = 128  # k per word group: the smallest K tile of the kernels; rows are zero-padded to a multiple

# Kernel word q (0..3) of a 32-block holds the codes of k = 4q..4q+3 (its elements j = 0..3) and
# k = 16+4q..16+4q+3 (j = 4..7): exactly the two 4-byte registers one thread of Hopper's wgmma holds
# for one row of a register A operand, so the expanded weights feed the MMA with no shuffle.
# Element j's 3 magnitude bits sit at bits 4j..4j+2, so the low and the high 16 bits are ready-made
# prmt selectors for the two output registers; its sign bit sits where the e4m3 sign of its output
# byte goes: 8j+7 for j < 4 (one AND), 8(j-4)+3 for j >= 4 (shift left by 4, one AND).
# Within each 128-k group the 16 words are stored q-major ([q][block]): the thread that owns word q
# of the group's 4 blocks reads them as one 16-byte vector, and a warp's reads hit distinct banks.
_MAG_BIT = tuple(4 * j for j in range(WORD_K))
_SIGN_BIT = tuple(8 * j + 7 if j < 4 else 8 * (j - 4) + 3 for j in range(WORD_K))


def padded_k(k: int) -> int:
    return -(-k // GROUP_K) * GROUP_K


def pack_kernel_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [N, K] (K % 32 == 0) -> int32 kernel words [N, padded_k(K) / 8]."""
    n, k = codes.shape
    kp = padded_k(k)
    if kp != k:
        codes = torch.cat([codes, codes.new_zeros(n, kp - k)], dim=1)
    # [N, group, block, h, q, i] -> [N, group, q, block, (h, i)]
    c = codes.reshape(n, kp // GROUP_K, 4, 2, 4, 4).permute(0, 1, 4, 2, 3, 5).reshape(n, kp // WORD_K, WORD_K)
    c = c.to(torch.int32)
    words = torch.zeros((n, kp // WORD_K), dtype=torch.int32, device=codes.device)
    for j in range(WORD_K):  # int32 shifts wrap into bit 31 as two's complement, which is what we store
        words |= ((c[..., j] & 7) << _MAG_BIT[j]) | ((c[..., j] >> 3) << _SIGN_BIT[j])
    return words


def unpack_kernel_words(words: torch.Tensor, k: int) -> torch.Tensor:
    """int32 kernel words [N, padded_k(K) / 8] -> e2m1 codes uint8 [N, K] in k order."""
    n, kw = words.shape
    codes = torch.empty((n, kw, WORD_K), dtype=torch.uint8, device=words.device)
    for j in range(WORD_K):
        codes[..., j] = (((words >> _MAG_BIT[j]) & 7) | (((words >> _SIGN_BIT[j]) & 1) << 3)).to(torch.uint8)
    # [N, group, q, block, h, i] -> [N, group, block, h, q, i]
    codes = codes.reshape(n, kw * WORD_K // GROUP_K, 4, 4, 2, 4).permute(0, 1, 3, 4, 2, 5)
    return codes.reshape(n, kw * WORD_K)[:, :k]


@dataclass
class PreparedMxfp4:
    """An MXFP4 weight in the layout the W4A8 kernels read."""

    w_q: torch.Tensor  # int32 [N, padded_k(K)/8], e2m1 codes in kernel words (pack_kernel_words)
    w_shift: torch.Tensor  # int8 [padded_k(K)/128, N, 4], block exponent minus ref, in [-5, 6]
    w_ref: torch.Tensor  # int32 [N], per-row reference exponent
    w_scale: torch.Tensor  # fp32 [N], 2^ref (the epilogue factor)
    in_features: int  # K
    underflow_blocks: int  # nonzero blocks re-rounded because they sat below the exact window

    @property
    def shape(self) -> tuple[int, int]:
        return self.w_q.shape[0], self.in_features

    def block_shifts(self) -> torch.Tensor:
        """int8 [N, K/32]: each block's exponent minus its row's reference."""
        groups, n, _ = self.w_shift.shape
        return self.w_shift.permute(1, 0, 2).reshape(n, groups * 4)[:, : self.in_features // MX_BLOCK]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_q, self.w_shift, self.w_ref, self.w_scale))

    def to(self, device) -> "PreparedMxfp4":
        return PreparedMxfp4(self.w_q.to(device), self.w_shift.to(device), self.w_ref.to(device),
                             self.w_scale.to(device), self.in_features, self.underflow_blocks)


def _group_major_shifts(shift: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/32] -> [padded_k(K)/128, N, 4] (zero shifts in the padding)."""
    n, blocks = shift.shape
    padded = padded_k(blocks * MX_BLOCK) // MX_BLOCK
    if padded != blocks:
        shift = torch.cat([shift, shift.new_zeros(n, padded - blocks)], dim=1)
    return shift.reshape(n, padded // 4, 4).permute(1, 0, 2).contiguous()


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
        w_q=pack_kernel_words(codes.reshape(n, 2 * half_k)),
        w_shift=_group_major_shifts(shift.to(torch.int8)),
        w_ref=ref.to(torch.int32).contiguous(),
        w_scale=w_scale.contiguous(),
        in_features=2 * half_k,
        underflow_blocks=underflow,
    )


@torch.no_grad()
def dequantize_prepared(prepared: PreparedMxfp4) -> torch.Tensor:
    """The exact fp32 weight [N, K] the kernels multiply with (equals the MXFP4 weight when no block underflowed)."""
    n, k = prepared.shape
    values = e2m1_to_float(unpack_kernel_words(prepared.w_q, k)).reshape(n, k // MX_BLOCK, MX_BLOCK)
    e = prepared.block_shifts().to(torch.int32) + prepared.w_ref[:, None]
    return scale_by_pow2(values, e[..., None]).reshape(n, k)


@torch.no_grad()
def unprepare_mxfp4(prepared: PreparedMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """PreparedMxfp4 -> (packed, scale_e8m0) in the standard MXFP4 layout (lossless without underflow)."""
    e = prepared.block_shifts().to(torch.int32) + prepared.w_ref[:, None]
    codes = unpack_kernel_words(prepared.w_q, prepared.shape[1])
    return pack_e2m1(codes), (e.clamp(-127, 127) + E8M0_BIAS).to(torch.uint8)
