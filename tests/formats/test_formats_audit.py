"""Audit of the 4-bit codecs against DESIGN.md sections 2-3, the OCP MX spec and the NVFP4 convention.

The reference here is deliberately simple and exact: Python Fractions, an exhaustive nearest-code search,
exponents found by counting. Random inputs span 1e-30 .. 1e30 so fp32 over/underflow inside the codecs
shows up as a difference.
"""

import math
from fractions import Fraction

import pytest
import torch

from radiance.formats import (Fp8Weight, dequantize_mxfp4, dequantize_nvfp4, dense_to_mxfp4, e2m1_to_float,
                              nvfp4_to_mxfp4, pack_e2m1, quantize_fp8_per_channel, quantize_mxfp4, quantize_nvfp4,
                              round_to_e2m1, to_mxfp4, unpack_e2m1)

GRID = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
TWO = Fraction(2)


def ref_code(x: Fraction) -> int:
    """Nearest e2m1 code, ties to the even code, saturating at 6; -0 and tiny negatives are code 0."""
    best = min(range(8), key=lambda c: (abs(GRID[c] - abs(x)), c % 2))
    return best | 8 if x < 0 and best else best


def ref_block_error(block: list[Fraction], e: int) -> Fraction:
    scale = TWO ** e
    return sum((v - GRID[ref_code(v / scale) & 7] * scale * (1 if v >= 0 else -1)) ** 2 for v in block)


def ref_exponent(block: list[Fraction], rule: str) -> int:
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0
    noclip = -200
    while amax > 6 * TWO ** noclip:  # smallest e with amax <= 6 * 2^e
        noclip += 1
    floor_log2 = math.frexp(float(amax))[1] - 1  # amax is an fp32 value: exact in a Python float
    candidates = {"noclip": noclip, "ocp": floor_log2 - 2, "mse": noclip}
    e = max(-127, min(127, candidates[rule]))
    if rule == "mse":
        lower = max(-127, min(127, noclip - 1))
        if ref_block_error(block, lower) < ref_block_error(block, e):  # a tie keeps noclip
            e = lower
    return e


def ref_quantize_mxfp4(w: torch.Tensor, rule: str) -> tuple[list[list[int]], list[list[int]]]:
    codes, scales = [], []
    for row in w.tolist():
        crow, srow = [], []
        for b in range(0, len(row), 32):
            block = [Fraction(v) for v in row[b:b + 32]]
            e = ref_exponent(block, rule)
            srow.append(e + 127)
            crow.extend(ref_code(v / TWO ** e) for v in block)
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def random_blocks(seed: int, magnitudes=(1e-30, 1e-22, 1e-3, 1.0, 1e20, 1e30)) -> torch.Tensor:
    """Rows of Gaussian blocks at very different magnitudes, plus an outlier, a zero block and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(2, 64, generator=gen) * m for m in magnitudes]
    w = torch.cat(rows)
    w[0, 32:] = 0.0  # an all-zero block
    w[1, 40] = 1e4  # one huge value in a tiny block
    w[2, :32] = torch.tensor([3.5, -2.5, 0.25, -0.75, 5.0, 1.25] * 5 + [0.0, -0.0])  # ties on the e=0 grid
    return w


@pytest.mark.parametrize("rule", ["mse", "noclip", "ocp"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_matches_exact_reference_at_every_magnitude(rule, seed):
    """`mse` compared squared errors in fp32 units of x: inf == inf above ~1e19, 0 == 0 below ~1e-22,
    so it kept noclip where noclip - 1 was better."""
    w = random_blocks(seed)
    packed, scale = quantize_mxfp4(w, rule)
    codes_ref, scale_ref = ref_quantize_mxfp4(w, rule)
    assert scale.tolist() == scale_ref
    assert unpack_e2m1(packed).tolist() == codes_ref


def test_mse_exact_tie_keeps_noclip():
    # 3.5 under e = 0 rounds to 4 (err .25); under e = -1 it clips to 3 (err .25): a tie -> noclip
    w = torch.zeros(1, 32)
    w[0, 0] = 3.5
    _, scale = quantize_mxfp4(w, "mse")
    assert ref_block_error([Fraction(3.5)], 0) == ref_block_error([Fraction(3.5)], -1)
    assert scale.tolist() == [[127]]


def test_e2m1_rounding_matches_exact_reference_on_random_values():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4000, generator=gen) * torch.logspace(-3, 1.2, 4000)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e-45, -1e-45, -0.0])
    x = torch.cat([x, ties, -ties])
    assert round_to_e2m1(x).tolist() == [ref_code(Fraction(v)) for v in x.tolist()]


@pytest.mark.parametrize("rule", ["mse", "noclip", "ocp"])
def test_representable_values_round_trip_exactly(rule):
    """Values on the e2m1 grid times 2^e (e in [-127, 125], so 6 * 2^e is finite) come back bit for bit."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (16, 128), generator=gen, dtype=torch.uint8)
    exps = torch.randint(-127, 126, (16, 4), generator=gen)
    values = e2m1_to_float(codes).double() * torch.repeat_interleave(2.0 ** exps.double(), 32, dim=1)
    w = values.float()
    assert torch.equal(w.double(), values)  # the inputs themselves are exact in fp32
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w, rule)), w)


def test_noclip_never_clips():
    w = random_blocks(5)
    deq = dequantize_mxfp4(*quantize_mxfp4(w, "noclip"))
    blocks, deq_blocks = w.reshape(-1, 32), deq.reshape(-1, 32)
    # never clipped: every block's largest magnitude is within half a grid step (1 * 2^e) of itself
    _, scale = quantize_mxfp4(w, "noclip")
    step = 2.0 ** (scale.reshape(-1).double() - 127)
    assert bool(((blocks.double() - deq_blocks.double()).abs().amax(-1) <= step).all())
    assert bool((deq_blocks.abs().amax(-1) * 2 >= blocks.abs().amax(-1)).all())


def test_nibble_order_matches_gpt_oss_and_compressed_tensors():
    """gpt-oss / transformers unpack: lut[byte & 0xF] at even k, lut[byte >> 4] at odd k; scale 2^(byte - 127)."""
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    gen = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (3, 16), generator=gen, dtype=torch.uint8)
    scale = torch.randint(110, 140, (3, 1), generator=gen, dtype=torch.uint8)
    expected = [[math.ldexp(lut[(byte >> shift) & 0xF], s[0] - 127) for byte in row for shift in (0, 4)]
                for row, s in zip(packed.tolist(), scale.tolist())]
    assert dequantize_mxfp4(packed, scale).tolist() == expected
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x43]]  # compressed-tensors: (odd << 4) | even


def test_nvfp4_tiny_partition_gets_a_finite_global_scale():
    """448 * 6 / amax overflowed fp32 below amax ~8e-36: global scale inf, unusable weight."""
    gen = torch.Generator().manual_seed(7)
    w = torch.cat([torch.randn(2, 32, generator=gen) * 1e-37, torch.randn(2, 32, generator=gen)])
    packed, scale, global_scale = quantize_nvfp4(w, (2, 2))
    assert bool(torch.isfinite(global_scale).all()) and bool(torch.isfinite(scale.float()).all())
    deq = dequantize_nvfp4(packed, scale, global_scale, (2, 2)).double()
    w = w.double()  # fp32 norms of 1e-37 values underflow
    for part in (slice(0, 2), slice(2, 4)):
        assert float((deq[part] - w[part]).norm() / w[part].norm()) < 0.2


def test_nvfp4_nan_block_scale_is_refused_with_its_absolute_position():
    packed, scale, global_scale = quantize_nvfp4(torch.randn(8, 32))
    scale[5, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NVFP4 block scale contains NaN.*\[5, 1\]"):
        dequantize_nvfp4(packed, scale, global_scale)
    with pytest.raises(ValueError, match=r"NVFP4 block scale contains NaN.*\[5, 1\]"):
        nvfp4_to_mxfp4(packed, scale, global_scale, chunk_rows=4)


def test_fp8_requant_nan_names_its_row_not_the_chunks():
    w8 = torch.randn(8, 32).to(torch.float8_e4m3fn)
    w8[6, 3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf \(first at index \[6, 3\]\)"):
        to_mxfp4(Fp8Weight(w8, torch.ones(8, 1)), chunk_rows=4)


def test_fp8_subnormal_row_does_not_become_nan():
    """amax / 448 underflowed to 0 for rows below ~3e-43: w / 0 gave NaN codes."""
    w = torch.tensor([[1e-44, 0.0, -3e-45, 4e-45], [1.0, -2.0, 0.5, 0.0]])
    w8, scale = quantize_fp8_per_channel(w)
    assert not bool(torch.isnan(w8.float()).any())
    assert torch.equal(w8.float() * scale, w)  # multiples of 2^-149 and small integers: exact


@pytest.mark.parametrize("quantize", [quantize_mxfp4, quantize_nvfp4, quantize_fp8_per_channel, dense_to_mxfp4,
                                      round_to_e2m1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_by_every_entry_point(quantize, bad):
    w = torch.zeros(2, 32)
    w[1, 7] = bad
    with pytest.raises(ValueError, match=r"NaN or inf \(first at index \[1, 7\]\)"):
        quantize(w)


@pytest.mark.parametrize("quantize", [quantize_mxfp4, quantize_nvfp4, quantize_fp8_per_channel, dense_to_mxfp4])
def test_fp8_input_is_quantized_not_a_traceback(quantize):
    """torch has no isfinite for float8: the NaN check raised NotImplementedError on an fp8 source."""
    w = torch.randn(2, 32)
    assert torch.equal(torch.cat([t.reshape(-1).float() for t in quantize(w.to(torch.float8_e4m3fn))[:2]]),
                       torch.cat([t.reshape(-1).float() for t in quantize(w.to(torch.float8_e4m3fn).float())[:2]]))


@pytest.mark.parametrize("sizes", [(3, 5, 1), (1, 1), (7,), (2, 9, 4)])
@pytest.mark.parametrize("chunk_rows", [1, 2, 5, 64])
def test_requant_partitions_equal_independent_conversions(sizes, chunk_rows):
    """Odd partition sizes and chunks that straddle them: each partition as if converted alone."""
    gen = torch.Generator().manual_seed(sum(sizes))
    parts = [torch.randn(n, 64, generator=gen) * 10.0 ** (i * 2 - 2) for i, n in enumerate(sizes)]
    packed, scale, global_scale = quantize_nvfp4(torch.cat(parts), sizes)
    got_p, got_s, _ = nvfp4_to_mxfp4(packed, scale, global_scale, sizes, chunk_rows=chunk_rows)
    row = 0
    for p, n in enumerate(sizes):
        alone = dequantize_nvfp4(packed[row:row + n], scale[row:row + n], global_scale[p:p + 1])
        want_p, want_s = quantize_mxfp4(alone)
        assert torch.equal(got_p[row:row + n], want_p) and torch.equal(got_s[row:row + n], want_s)
        row += n


def test_int4_scale_of_the_wrong_shape_is_refused_not_broadcast():
    """A [N, 1] scale for K = 64 broadcast silently over both groups of 32."""
    from radiance.formats import dequantize_int4

    packed = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int4 shapes disagree"):
        dequantize_int4(packed, torch.ones(2, 1), torch.zeros(2, 1))
    assert dequantize_int4(packed, torch.ones(2, 2), torch.full((2, 2), -8.0)).eq(-8.0).all()


def test_nvfp4_block_scales_round_to_nearest_even_e4m3_and_saturate():
    """The e4m3 block scale is the fp32 value amax / 6 * gs rounded to nearest, ties to even, capped at 448."""
    finite = sorted({v for v in torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()})

    def ref_e4m3(x: float) -> float:
        x = min(x, 448.0)
        return min(finite, key=lambda v: (abs(Fraction(v) - Fraction(x)), finite.index(v) % 2))

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(8, 256, generator=gen) * torch.logspace(-4, 2, 8).unsqueeze(1)
    _, scale, gs = quantize_nvfp4(w)
    wanted = (w.reshape(8, 16, 16).abs().amax(-1) / 6.0 * gs)  # the fp32 value the codec rounds
    assert scale.float().tolist() == [[ref_e4m3(v) for v in row] for row in wanted.tolist()]
    assert scale.float().max().item() == 448.0  # the tensor's largest block sits exactly at the top


def test_int4_to_mxfp4_is_row_chunked(monkeypatch):
    """DESIGN section 3: requant works in row chunks; int4 sources were dequantized whole."""
    import radiance.formats.weights as weights_module
    from radiance.formats import Int4Weight, dequantize

    gen = torch.Generator().manual_seed(9)
    weight = Int4Weight(torch.randint(0, 256, (10, 32), generator=gen, dtype=torch.uint8),
                        torch.rand(10, 2, generator=gen), torch.randn(10, 2, generator=gen))
    whole = quantize_mxfp4(dequantize(weight))
    seen = []
    real = weights_module.dequantize_int4

    def spy(packed, scale, offset):
        seen.append(packed.shape[0])
        return real(packed, scale, offset)

    monkeypatch.setattr(weights_module, "dequantize_int4", spy)
    converted, rel = to_mxfp4(weight, chunk_rows=4)
    assert seen and max(seen) <= 4
    assert torch.equal(converted.packed, whole[0]) and torch.equal(converted.scale, whole[1]) and 0 < rel < 0.3


@pytest.mark.gpu
def test_codecs_give_the_same_bytes_on_cuda_and_cpu():
    """formats/ is the bit-exact reference on both devices. CUDA divides by a Python number through its
    rounded reciprocal: FP8 per-channel scales came out one ulp off the CPU's."""
    gen = torch.Generator().manual_seed(10)
    w = torch.cat([random_blocks(11), torch.randn(64, 64, generator=gen) * torch.logspace(-6, 3, 64).unsqueeze(1),
                   torch.tensor([[1e-44, 2.0 ** -130, 1e-38, 3e38] * 16])])
    sizes = (4, 64, 9)  # 12 + 64 + 1 rows, split across the groups
    for quantize in (lambda t: quantize_mxfp4(t, "mse"), lambda t: quantize_mxfp4(t, "noclip"),
                     lambda t: quantize_mxfp4(t, "ocp"), lambda t: quantize_nvfp4(t, sizes), quantize_fp8_per_channel):
        on_cpu, on_gpu = quantize(w), quantize(w.cuda())
        for a, b in zip(on_cpu, on_gpu):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               (b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b).cpu())
    packed, scale, global_scale = quantize_nvfp4(w, sizes)
    on_cpu = nvfp4_to_mxfp4(packed, scale, global_scale, sizes, chunk_rows=7)
    on_gpu = nvfp4_to_mxfp4(packed.cuda(), scale.cuda(), global_scale.cuda(), sizes, chunk_rows=7)
    assert torch.equal(on_cpu[0], on_gpu[0].cpu()) and torch.equal(on_cpu[1], on_gpu[1].cpu())
