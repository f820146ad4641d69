import torch

from radiance.formats import dequantize_mxfp4
from radiance.kernels.reference import MIN_SCALE, quantize_activations_reference, relative_error, w4a8_reference
from tests.kernels.conftest import random_mxfp4


def test_reference_scale_and_rounding():
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-3, 2.0, -3.0, 0.5]])
    x_q, scale = quantize_activations_reference(x)
    assert scale[0, 0] == 1.0 and scale[1, 0] == torch.tensor(MIN_SCALE, dtype=torch.float32)
    assert scale[2, 0] == torch.tensor(3.0 / 448.0, dtype=torch.float32)
    assert torch.equal(x_q[0].float(), torch.tensor([448.0, -224.0, 1.0, 0.0]))
    assert torch.equal(x_q[1].float(), torch.zeros(4))
    assert x_q[2, 2].float() == -448.0  # the row max maps to the fp8 max
    # values between grid points round to nearest: 1e-3 / (3/448) = 0.1493 -> e4m3 0.15625
    assert x_q[2, 0].float() == 0.15625


def test_reference_nan_token_is_isolated():
    x = torch.randn(4, 64)
    clean, clean_s = quantize_activations_reference(x)
    x[1, 5] = float("nan")
    x_q, x_s = quantize_activations_reference(x)
    assert torch.equal(x_q[[0, 2, 3]].view(torch.uint8), clean[[0, 2, 3]].view(torch.uint8))
    assert torch.isnan(x_s[1]).all()


def test_w4a8_reference_is_exact_fp32_math():
    packed, scale = random_mxfp4(24, 96, "cpu")
    x = torch.randn(3, 2, 96)
    bias = torch.randn(24)
    out = w4a8_reference(x, packed, scale, bias)
    assert out.shape == (3, 2, 24) and out.dtype == torch.float32
    # independent float64 computation from the dequantized operands
    x_q, x_s = quantize_activations_reference(x.reshape(-1, 96))
    exact = (x_q.double() * x_s.double()) @ dequantize_mxfp4(packed, scale).double().t() + bias.double()
    assert relative_error(out.reshape(-1, 24), exact) < 1e-6
    assert w4a8_reference(x.bfloat16(), packed, scale).dtype == torch.bfloat16
