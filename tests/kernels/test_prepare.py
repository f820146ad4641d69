import pytest
import torch

from radiance.formats import dequantize_mxfp4, pack_e2m1, quantize_mxfp4, unpack_e2m1
from radiance.kernels.prepare import (SHIFT_MAX, SHIFT_MIN, dequantize_prepared, pack_kernel_words, prepare_mxfp4,
                                      unpack_kernel_words, unprepare_mxfp4)
from tests.kernels.conftest import random_mxfp4


def test_prepare_is_exact_and_reversible():
    packed, scale = random_mxfp4(40, 256, "cpu", spread=11)  # 12 exponents: the full exact window
    pw = prepare_mxfp4(packed, scale)
    assert pw.underflow_blocks == 0
    assert torch.equal(dequantize_prepared(pw), dequantize_mxfp4(packed, scale))
    p2, s2 = unprepare_mxfp4(pw)
    assert torch.equal(p2, packed)
    live = (unpack_e2m1(packed).reshape(40, -1, 32) & 7).amax(-1) > 0
    assert torch.equal(s2[live], scale[live])
    assert int(pw.block_shifts().min()) >= SHIFT_MIN and int(pw.block_shifts().max()) <= SHIFT_MAX
    # the row reference puts the largest live block at the top of the window
    assert torch.equal(pw.block_shifts().amax(dim=1).to(torch.int32), torch.full((40,), SHIFT_MAX, dtype=torch.int32))
    assert torch.equal(pw.w_scale, torch.exp2(pw.w_ref.float()))


def test_underflow_blocks_are_counted_and_rerounded():
    k = 128
    codes = torch.zeros(2, k, dtype=torch.uint8)
    codes[0, :32] = 7  # block 0 of row 0: 6 * 2^0
    codes[0, 32:64] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 9] * 4, dtype=torch.uint8)  # block 1: far below
    codes[0, 64:96] = 0  # an all-zero block never counts, whatever its scale
    codes[1, :32] = 3
    scale = torch.full((2, k // 32), 127, dtype=torch.uint8)
    scale[0, 1] = 127 - 13  # 13 exponents below the row's top block: shift -13 - 6 + ... < -5
    scale[0, 2] = 0
    pw = prepare_mxfp4(pack_e2m1(codes), scale)
    assert pw.underflow_blocks == 1
    w = dequantize_prepared(pw)
    exact = dequantize_mxfp4(pack_e2m1(codes), scale)
    assert torch.equal(w[:, :32], exact[:, :32]) and torch.equal(w[1], exact[1])
    # block 1 values were e2m1 * 2^-13; the coarsest exact grid below ref (2^-6 * 2^-5 * 0.5) keeps only the top
    grid = 2.0 ** (pw.w_ref[0].item() + SHIFT_MIN) * 0.5
    assert torch.all(torch.remainder(w[0, 32:64], grid) == 0)
    assert (w[0, 32:64] - exact[0, 32:64]).abs().max() <= grid


def test_quantized_weights_roundtrip_through_prepare():
    w = torch.randn(24, 96)
    packed, scale = quantize_mxfp4(w)
    pw = prepare_mxfp4(packed, scale)
    assert torch.equal(dequantize_prepared(pw), dequantize_mxfp4(packed, scale))


@pytest.mark.parametrize("bad", ["nan_scale", "shape"])
def test_prepare_rejects_bad_input(bad):
    packed, scale = random_mxfp4(4, 64, "cpu")
    if bad == "nan_scale":
        scale[0, 0] = 255
        with pytest.raises(ValueError, match="0xFF"):
            prepare_mxfp4(packed, scale)
    else:
        with pytest.raises(ValueError, match="disagree"):
            prepare_mxfp4(packed, scale[:, :1])


@pytest.mark.parametrize("k", [32 * 10, 256])
def test_kernel_words_layout_bit_by_bit(k):
    """In a 128-k group, word 4q+b holds block b's k = 4q+i as element i and k = 16+4q+i as element 4+i;
    element j's magnitude at bits 4j..4j+2, its sign at 8j+7 (j < 4) or 8(j-4)+3 (j >= 4). Rows are
    zero-padded to a multiple of 128."""
    codes = torch.randint(0, 16, (64, k), dtype=torch.uint8)
    words = pack_kernel_words(codes)
    assert words.dtype == torch.int32 and words.shape == (64, -(-k // 128) * 16)
    assert torch.equal(unpack_kernel_words(words, k), codes)
    for kk in range(0, k, 7):  # slow, one code at a time, independent of the packer's reshapes
        one = torch.zeros(1, k, dtype=torch.uint8)
        one[0, kk] = 0xF  # -6: all three magnitude bits and the sign
        group, block, h, q, i = kk // 128, (kk % 128) // 32, (kk % 32) // 16, (kk % 16) // 4, kk % 4
        j = 4 * h + i
        packed = pack_kernel_words(one)[0]
        assert int((packed != 0).sum()) == 1
        bits = int(packed[group * 16 + 4 * q + block]) & 0xFFFFFFFF
        sign = 8 * j + 7 if j < 4 else 8 * (j - 4) + 3
        assert bits == (7 << (4 * j)) | (1 << sign), (kk, hex(bits))
