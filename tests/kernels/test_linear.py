import logging

import pytest
import torch

from radiance.config import KernelConfig
from radiance.formats import DenseWeight, Nvfp4Weight, dequantize, dequantize_mxfp4, quantize_mxfp4, quantize_nvfp4
from radiance.kernels.numerics import NumericsMonitor
from radiance.kernels.reference import quantize_activations_reference, relative_error, w4a8_reference
from radiance.layers.linear import DenseLinear, Mxfp4Linear, Mxfp4PairLinear, choose_path, linear_summary
from tests.kernels.conftest import random_mxfp4


def test_cpu_layer_is_the_exact_reference():
    packed, scale = random_mxfp4(40, 96, "cpu")
    bias = torch.randn(40)
    layer = Mxfp4Linear(packed, scale, bias)
    assert layer.path == "reference" and "cpu" in layer.path_reason
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 96).to(dtype)
        out = layer(x)
        assert out.shape == (2, 5, 40) and out.dtype == dtype
        assert torch.equal(out, w4a8_reference(x, packed, scale, bias))
    x_q, x_s = quantize_activations_reference(x.reshape(-1, 96))
    assert torch.equal(layer.forward_quantized(x_q, x_s, torch.bfloat16), out.reshape(-1, 40))
    assert torch.equal(layer.dequantized_weight(), dequantize_mxfp4(packed, scale))


def test_pair_layer_multiplies_by_the_sum_of_its_terms():
    """Mxfp4PairLinear over [Q1 | Q2]: the layer of Q1 + Q2 with x's fp8 quantization (one scale per token for
    both halves of [x | x]), on the reference path here and on the W4A8 kernel in test_gpu.py."""
    packed, scale = random_mxfp4(40, 2 * 96, "cpu")
    layer = Mxfp4PairLinear(packed, scale)
    assert (layer.in_features, layer.out_features, layer.path) == (96, 40, "reference")
    w = dequantize_mxfp4(packed, scale)
    assert torch.equal(layer.dequantized_weight(), w[:, :96] + w[:, 96:])
    x = torch.randn(2, 5, 96)
    x_q, x_s = quantize_activations_reference(x.reshape(-1, 96))
    expected = (x_q.float() * x_s) @ layer.dequantized_weight().t()
    out = layer(x)
    assert out.shape == (2, 5, 40)
    torch.testing.assert_close(out.reshape(-1, 40), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        Mxfp4PairLinear(*random_mxfp4(8, 96, "cpu"))


def test_from_weight_converts_any_format():
    w = torch.randn(32, 64)
    layer, rel = Mxfp4Linear.from_weight(DenseWeight(w))
    assert 0.05 < rel < 0.2  # MXFP4 of a Gaussian weight: ~0.11 relative RMS
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(layer.dequantized_weight(), dequantize_mxfp4(packed, scale))
    nv = Nvfp4Weight(*quantize_nvfp4(w))
    layer_nv, rel_nv = Mxfp4Linear.from_weight(nv, rule="noclip")
    assert rel_nv > 0 and relative_error(layer_nv.dequantized_weight(), dequantize(nv)) == pytest.approx(rel_nv, rel=1e-3)


def test_paths_and_summary():
    packed, scale = random_mxfp4(16, 64, "cpu")
    ref_layer = Mxfp4Linear(packed, scale)
    w4a16 = Mxfp4Linear(packed, scale, kernel_config=KernelConfig(activations="bf16"))
    assert w4a16.path == "w4a16"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    exact = x.float() @ dequantize_mxfp4(packed, scale).t()
    assert relative_error(w4a16(x), exact) < 1e-2
    # a float32 caller: the weight is converted once (bf16 values, exact in fp32), not on every call
    out32 = w4a16(x.float())
    assert out32.dtype == torch.float32 and w4a16.w_dense.dtype == torch.float32
    assert relative_error(out32, exact) < 1e-5
    assert choose_path(torch.device("cpu"), KernelConfig(use_triton=False))[1] == "use_triton=False"
    model = torch.nn.ModuleList([ref_layer, w4a16, DenseLinear(torch.randn(8, 64))])
    line = linear_summary(model)
    assert line.startswith("0/2 linears on the W4A8 kernel")
    assert "1 on reference (cpu: exact reference path)" in line and "1 on w4a16" in line and "1 dense" in line


def test_numerics_monitor_reports_bad_outputs(caplog):
    packed, scale = random_mxfp4(16, 64, "cpu")
    w = dequantize_mxfp4(packed, scale)
    x_q, x_s = quantize_activations_reference(torch.randn(4, 64))
    good = (x_q.float() * x_s) @ w.t()
    monitor = NumericsMonitor("layer0", every=2)
    assert [monitor.due() for _ in range(4)] == [True, False, True, False]
    with caplog.at_level(logging.WARNING):
        assert monitor.check(x_q, x_s, w, None, good) < 1e-6
        assert monitor.failures == 0
        monitor.check(x_q, x_s, w, None, good * 1.01)
    assert monitor.failures == 1 and "layer0" in caplog.text


def test_norm_hands_fp8_activations_to_the_layer_unchanged():
    """The model's fused path (RMSNorm emitting Fp8Activations, the layer consuming them) computes what
    norm -> layer does; on the CPU both sides are the torch reference, so they agree exactly."""
    from radiance.kernels.activation import Fp8Activations
    from radiance.kernels.glu import silu_mul
    from radiance.layers.linear import takes_fp8
    from radiance.layers.norm import RMSNorm

    packed, scale = random_mxfp4(24, 64, "cpu")
    layer = Mxfp4Linear(packed, scale, torch.randn(24))
    assert not takes_fp8(layer) and not takes_fp8(DenseLinear(torch.randn(24, 64)))  # CPU: reference path
    norm = RMSNorm(64)
    norm.weight.data = torch.rand(64) + 0.5
    x, res = torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    act, summed = norm(x, res, fp8=True)
    plain, summed2 = norm(x, res)
    assert isinstance(act, Fp8Activations) and act.lead == (3, 4) and act.x_q.shape == (12, 64)
    assert torch.equal(summed, summed2)
    assert torch.equal(layer(act), layer(plain))
    gate_up = torch.randn(5, 2 * 64)
    act2 = silu_mul(gate_up, quantize=True)
    plain2 = silu_mul(gate_up)
    assert torch.equal(plain2, torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:])
    assert torch.equal(layer(act2), layer(plain2))


@pytest.mark.parametrize("m, n, splits, pays", [
    (1, 4096, 4, True),  # 4 x 16 KiB per row: the 8B's o_proj / down_proj at batch 1
    (1, 5120, 6, True),  # 6 x 20 KiB: the 32B's down_proj at batch 1 (thirty-fourth session: -30 us per step)
    (1, 8192, 4, True),  # 128 KiB, the limit
    (1, 8192, 6, False),  # 192 KiB: one program would read it all
    (1, 5120, 1, True),
    (8, 5120, 6, True),  # from two rows on the norm's programs spread over SMs
    (65, 4096, 4, False),  # past the decode band
    (0, 4096, 4, False),
])
def test_deferring_pays_where_one_program_reads_little(monkeypatch, m, n, splits, pays):
    """w4a8.deferring_pays: at M = 1 one norm program reads every partial row, so only small ones defer."""
    from radiance.kernels import w4a8
    from radiance.kernels.tuning import GemmConfig

    monkeypatch.setattr(w4a8, "sm_count", lambda device: 132)
    monkeypatch.setattr(w4a8, "select_config", lambda *a: GemmConfig(block_m=16, block_n=64, block_k=256,
                                                                       swap_ab=True, split_k=splits))
    assert w4a8.deferring_pays(m, n, 32768, 64, torch.device("cpu")) == pays


def test_cpu_layer_never_defers_its_sum():
    """forward_for_norm off the W4A8 kernel is forward: a tensor, never PartialSums."""
    layer = Mxfp4Linear(*random_mxfp4(40, 96, "cpu"))
    x = torch.randn(3, 96)
    assert torch.equal(layer.forward_for_norm(x), layer(x))
