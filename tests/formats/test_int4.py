"""Int4Weight: GGUF Q4_0 / Q4_1 blocks read without rounding, and the format's place among the others."""

import gguf
import numpy as np
import pytest
import torch

from radiance.checkpoint.gguf_blocks import int4_from_blocks
from radiance.formats import (DenseWeight, Int4Weight, concat_partitions, dense_to_mxfp4, dequantize, nbytes,
                              to_mxfp4)


def gguf_blocks(values: np.ndarray, type_name: str) -> np.ndarray:
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return gguf.quants.quantize(values, qtype)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows, cols", [(16, 32), (48, 96), (5, 576)])
def test_blocks_dequantize_bit_for_bit_like_gguf(type_name, rows, cols):
    rng = np.random.default_rng(rows * cols)
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block (scale 0)
    values[-1, -32:] += 5.0  # a block far from zero (Q4_1's min does the work)
    blocks = gguf_blocks(values, type_name)
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, type_name))))
    weight = int4_from_blocks(blocks, type_name, rows, cols)
    assert weight.format == "int4" and weight.shape == (rows, cols)
    assert torch.equal(dequantize(weight), expected)
    # 4 bits per weight plus two fp32 numbers per 32 weights
    assert nbytes(weight) == rows * cols // 2 + 2 * 4 * rows * cols // 32


@pytest.mark.parametrize("rows, cols", [(16, 256), (3, 768)])
def test_q4_k_blocks_dequantize_bit_for_bit_like_gguf(rows, cols):
    """Q4_K (llama.cpp's usual 4-bit type): random super-blocks, every 6-bit scale and min pattern."""
    rng = np.random.default_rng(rows + cols)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    for at in (0, 2):  # d and dmin: finite fp16
        blocks[:, at:at + 2] = rng.uniform(1e-4, 2e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks = blocks.reshape(rows, -1)
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)))
    weight = int4_from_blocks(blocks, "Q4_K", rows, cols)
    assert torch.equal(dequantize(weight), expected.reshape(rows, cols))
    assert (weight.offset <= 0).all() and (weight.scale >= 0).all()


def test_malformed_weights_are_refused():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        Int4Weight(packed.to(torch.int16), torch.ones(4, 1), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="do not match"):
        Int4Weight(packed, torch.ones(4, 2), torch.zeros(4, 1))


def random_int4(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02
    offset = -8 * scale + 0.01 * torch.randn(rows, cols // 32, generator=g)
    return Int4Weight(packed, scale, offset)


def test_merging_and_conversion_go_through_the_values():
    a, b = random_int4(32, 64, 1), random_int4(16, 64, 2)
    merged = concat_partitions([a, b])
    assert merged.format == "int4" and merged.partition_sizes == (32, 16)
    assert torch.equal(dequantize(merged), torch.cat([dequantize(a), dequantize(b)]))
    mx, err = to_mxfp4(merged)
    packed, scale, expected_err = dense_to_mxfp4(dequantize(merged), "mse")
    assert torch.equal(mx.packed, packed) and torch.equal(mx.scale, scale) and err == expected_err
    assert mx.partition_sizes == (32, 16)
    assert not isinstance(merged, DenseWeight)
