"""NVFP4 -> MXFP4 requantization and the weight containers, against slow references."""

import pytest
import torch

from radiance.formats import (DenseWeight, Fp8Weight, Mxfp4Weight, Nvfp4Weight, concat_partitions, dequantize,
                              dequantize_mxfp4, e2m1_to_float, nvfp4_to_mxfp4, quantize_fp8_per_channel,
                              quantize_mxfp4, quantize_nvfp4, to_mxfp4, unpack_e2m1)
from tests.formats.test_codecs import slow_quantize_mxfp4


def slow_dequantize_nvfp4(packed, scale, global_scale, sizes):
    """Element by element, each row divided by the global scale of the partition it belongs to."""
    codes = unpack_e2m1(packed)
    values = e2m1_to_float(codes).tolist()
    scales = scale.float().tolist()
    owner = [p for p, size in enumerate(sizes) for _ in range(size)]
    out = [[v * scales[n][k // 16] / float(global_scale[owner[n]]) for k, v in enumerate(row)]
           for n, row in enumerate(values)]
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("rule", ["mse", "noclip", "ocp"])
def test_nvfp4_to_mxfp4_matches_slow_reference(rule):
    torch.manual_seed(2)
    sizes = (8, 4, 4)
    w = torch.cat([torch.randn(8, 96) * 0.02, torch.randn(4, 96) * 0.5, torch.randn(4, 96) * 7.0])
    packed, scale, gs = quantize_nvfp4(w, sizes)
    got_p, got_s, rel = nvfp4_to_mxfp4(packed, scale, gs, sizes, rule=rule, chunk_rows=3)  # chunks cross partitions
    deq = slow_dequantize_nvfp4(packed, scale, gs, sizes)
    codes_ref, scale_ref = slow_quantize_mxfp4(deq, rule)
    assert torch.equal(got_s, scale_ref)
    assert torch.equal(unpack_e2m1(got_p), codes_ref)
    expected_rel = ((deq - dequantize_mxfp4(got_p, got_s)).norm() / deq.norm()).item()
    assert rel == pytest.approx(expected_rel, rel=1e-6)


def test_two_partitions_are_not_collapsed_with_max():
    torch.manual_seed(3)
    sizes = (4, 4)
    w = torch.cat([torch.randn(4, 64) * 1e-3, torch.randn(4, 64) * 10.0])
    packed, scale, gs = quantize_nvfp4(w, sizes)
    assert gs[0] / gs[1] > 100  # very different global scales
    p, s, _ = nvfp4_to_mxfp4(packed, scale, gs, sizes)
    collapsed = torch.full_like(gs, gs.max().item())
    p_bad, s_bad, _ = nvfp4_to_mxfp4(packed, scale, collapsed, sizes)
    assert not torch.equal(s, s_bad)  # max() would give a different (wrong) result
    per_part = torch.cat([dequantize_mxfp4(*quantize_mxfp4(slow_dequantize_nvfp4(packed[:4], scale[:4], gs[:1], (4,)))),
                          dequantize_mxfp4(*quantize_mxfp4(slow_dequantize_nvfp4(packed[4:], scale[4:], gs[1:], (4,))))])
    assert torch.equal(dequantize_mxfp4(p, s), per_part)


def test_concat_partitions_keeps_every_global_scale():
    parts = [Nvfp4Weight(*quantize_nvfp4(torch.randn(n, 32) * m)) for n, m in ((6, 1.0), (2, 50.0), (2, 0.1))]
    merged = concat_partitions(parts)
    assert merged.partition_sizes == (6, 2, 2) and merged.global_scale.numel() == 3
    assert torch.equal(dequantize(merged), torch.cat([dequantize(p) for p in parts]))
    with pytest.raises(ValueError, match="cannot merge"):
        concat_partitions([parts[0], DenseWeight(torch.randn(2, 32))])


def test_to_mxfp4_from_every_format():
    torch.manual_seed(4)
    w = torch.randn(16, 64)
    direct, rel_direct = to_mxfp4(DenseWeight(w.to(torch.bfloat16)))
    p, s = quantize_mxfp4(w.to(torch.bfloat16).float())
    assert torch.equal(direct.packed, p) and torch.equal(direct.scale, s)
    assert 0.05 < rel_direct < 0.2
    w8, sc = quantize_fp8_per_channel(w)
    from_fp8, rel_fp8 = to_mxfp4(Fp8Weight(w8, sc), chunk_rows=5)
    p8, s8 = quantize_mxfp4(w8.float() * sc)
    assert torch.equal(from_fp8.packed, p8) and torch.equal(from_fp8.scale, s8) and rel_fp8 > 0
    same, zero = to_mxfp4(direct)
    assert same is direct and zero == 0.0
    merged = concat_partitions([DenseWeight(w[:10]), DenseWeight(w[10:])])
    m, _ = to_mxfp4(merged)
    assert isinstance(m, Mxfp4Weight) and m.partition_sizes == (10, 6)


def test_weight_containers_validate_shapes():
    with pytest.raises(ValueError, match="scale shape"):
        Mxfp4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Nvfp4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2), torch.ones(1))
    with pytest.raises(ValueError, match="global scale"):
        Nvfp4Weight(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float8_e4m3fn),
                    torch.ones(2), (4,))


@pytest.mark.parametrize("rule", ["mse", "ocp"])
def test_mxfp4_pair_is_the_head_then_its_residual(rule):
    """dense_to_mxfp4_pair: [Q(W) | Q(W - Q(W))] byte for byte, its relRMS that of Q1 + Q2, row-chunked or not,
    and the pair ~8x closer to W than one term."""
    from radiance.formats import dense_to_mxfp4, dense_to_mxfp4_pair

    w = torch.randn(40, 96) * torch.logspace(-2, 1, 40)[:, None]
    packed, scale, rel = dense_to_mxfp4_pair(w, rule)
    assert packed.shape == (40, 96) and scale.shape == (40, 6)
    p1, s1, rel1 = dense_to_mxfp4(w, rule)
    p2, s2, _ = dense_to_mxfp4(w - dequantize_mxfp4(p1, s1), rule)
    assert torch.equal(packed, torch.cat((p1, p2), 1)) and torch.equal(scale, torch.cat((s1, s2), 1))
    both = dequantize_mxfp4(packed, scale)
    pair = both[:, :96] + both[:, 96:]
    assert rel == pytest.approx(float((w - pair).norm() / w.norm()), rel=1e-5)
    assert rel < rel1 / 5
    chunked = dense_to_mxfp4_pair(w, rule, chunk_rows=7)
    assert torch.equal(chunked[0], packed) and torch.equal(chunked[1], scale) and chunked[2] == pytest.approx(rel)


@pytest.mark.parametrize("magnitude", [2.0 ** -84, 2.0 ** 66])  # powers of two: the same codes, scaled exactly
def test_the_relrms_report_holds_for_weights_far_from_one(magnitude):
    """relRMS is scale-free: fp32 squares of weights near 1e20 overflowed (nan) and near 1e-25 underflowed (0)."""
    from radiance.checkpoint.convert import rel_rms
    from radiance.formats import dense_to_mxfp4

    torch.manual_seed(3)
    w = torch.randn(8, 64)
    _, _, unit = dense_to_mxfp4(w)
    _, _, scaled = dense_to_mxfp4(w * magnitude)
    assert 0.05 < unit < 0.2 and scaled == pytest.approx(unit, rel=1e-6)
    assert rel_rms(torch.full((5,), 1.1 * magnitude), torch.full((5,), magnitude)) == pytest.approx(0.1, rel=1e-6)
    assert rel_rms(torch.zeros(3), torch.zeros(3)) == 0.0
