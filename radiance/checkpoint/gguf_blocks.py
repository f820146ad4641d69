"""GGUF tensor blocks read into radiance's weights without rounding: ggml's MXFP4 blocks as Mxfp4Weight, Q4_0 / Q4_1 /
Q4_K blocks as Int4Weight (codes, scales and offsets); and which other GGML types the gguf package dequantizes."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import torch

from radiance.formats import Int4Weight, Mxfp4Weight, pack_e2m1

# GGUF types whose values are exactly code * scale + offset per 32 weights: (bytes per block, weights per
# block, codes per nibble run: code byte j holds code j of a run in its low nibble and of the next run in
# its high nibble)
INT4_TYPES = {"Q4_0": (18, 32, 16), "Q4_1": (20, 32, 16), "Q4_K": (144, 256, 32)}


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The GGML tensor types the gguf package dequantizes (probed: the list grows with its version)."""
    readable = []
    for qtype in gguf.GGMLQuantizationType:
        block_bytes = gguf.GGML_QUANT_SIZES.get(qtype, (0, 0))[1]
        try:
            gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError):
            continue
        readable.append(qtype.name)
    return tuple(readable)


def mxfp4_from_blocks(blocks: np.ndarray, rows: int, cols: int) -> Mxfp4Weight:
    """ggml's MXFP4 blocks of a [rows, cols] tensor (17 bytes per 32 weights: the e8m0 exponent, then 16 code bytes
    whose low nibbles hold weights 0-15 and high nibbles 16-31) -> Mxfp4Weight, the same e2m1 codes and exponents
    in radiance's packing (a byte holds weights 2i and 2i + 1, the even one in its low nibble): no rounding."""
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True)).reshape(rows, cols // 32, 17)
    codes = torch.cat((raw[..., 1:] & 0x0F, raw[..., 1:] >> 4), dim=-1)  # [rows, blocks, 32] in weight order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Mxfp4Weight(packed.reshape(rows, cols // 2).contiguous(), raw[..., 0].contiguous())


def int4_from_blocks(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> Int4Weight:
    """Raw Q4_0 / Q4_1 / Q4_K blocks of a [rows, cols] tensor -> Int4Weight with the same values.

    Q4_0 / Q4_1 (32 weights: fp16 scale [, fp16 min], 16 code bytes): w = scale * (code - 8), or
    scale * code + min. Q4_K (256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 code
    bytes): group g of 32 has scale d * sc[g] and offset -dmin * m[g], products exact in fp32 as in the
    gguf package.
    """
    block_bytes, block_weights, run = INT4_TYPES[type_name]
    per_row = cols // block_weights
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True).reshape(rows, per_row, block_bytes))

    def fp16_field(at: int) -> torch.Tensor:
        return raw[..., at:at + 2].contiguous().view(torch.float16).reshape(rows, per_row).float()

    if type_name == "Q4_K":
        sc, m = (torch.from_numpy(a.astype(np.float32)).reshape(rows, per_row, 8)
                 for a in gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12).numpy()))
        scale = (fp16_field(0).unsqueeze(-1) * sc).reshape(rows, -1)
        offset = -(fp16_field(2).unsqueeze(-1) * m).reshape(rows, -1)
    else:
        scale = fp16_field(0)
        offset = fp16_field(2) if type_name == "Q4_1" else -8.0 * scale
    code_bytes = raw[..., block_bytes - block_weights // 2:].reshape(rows, per_row, -1, run)
    codes = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-2)  # low-nibble run, then high-nibble run
    return Int4Weight(pack_e2m1(codes.reshape(rows, cols)), scale, offset)
