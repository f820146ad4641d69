"""gated_rms_norm_quant (the gated RMSNorm of each value head and the token's e4m3 quantization in one launch) vs the
two launches it replaces, quantize_activations(gated_rms_norm(...)), byte for byte (run on CUDA, or on the CPU
through the Triton interpreter by test_triton_interpreter.py): 16- and 32-bit inputs, head counts and widths off a
power of two, strided gates, a NaN kept to its token, an all-zero token, argument errors."""

import pytest
import torch

from radiance.kernels._triton.gated_delta import gated_rms_norm
from radiance.kernels._triton.gated_norm_quant import gated_rms_norm_quant
from radiance.kernels.activation import quantize_activations

MIN_SCALE = 1.0 / (448.0 * 512.0)


def _inputs(batch, heads, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + 97 * batch + 13 * heads + dim)
    x = (torch.randn(batch * heads, dim, generator=gen) * 3).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(device, dtype)
    # the gate as the decode step hands it over: z, the tail of in_proj's rows [B, C + H * D], viewed [B, H, D]
    projection = (torch.randn(batch, 24 + heads * dim, generator=gen) * 2).to(device, dtype)
    gate = projection[:, 24:].view(batch, heads, dim)
    return x, gate, weight


def _two_launches(x, gate, weight, eps):
    batch, heads, dim = gate.shape
    return quantize_activations(gated_rms_norm(x, gate, weight, eps).reshape(batch, heads * dim))


def _assert_same_bytes(got, want):
    x_q, x_scale = want
    assert got.x_q.shape == x_q.shape and got.x_q.dtype == torch.float8_e4m3fn
    assert got.x_scale.shape == x_scale.shape and got.x_scale.dtype == torch.float32
    if got.dtype == torch.float32 and x_q.is_cuda:
        # compiled, the tile's per-head sums of squares add in another order than the one-head kernel's: an fp32
        # norm output (no 16-bit rounding to absorb it) may move by an ulp, so the scale by an ulp and a code by a
        # step (seen on an H100)
        assert (got.x_scale.view(torch.int32) - x_scale.view(torch.int32)).abs().max() <= 1
        assert (got.x_q.view(torch.uint8).int() - x_q.view(torch.uint8).int()).abs().max() <= 1
        return
    assert torch.equal(got.x_q.view(torch.uint8), x_q.view(torch.uint8))
    assert torch.equal(got.x_scale.view(torch.int32), x_scale.view(torch.int32))  # NaN scales too


@pytest.mark.parametrize("batch, heads, dim, eps", [(1, 4, 32, 1e-6), (3, 3, 40, 1e-6), (2, 5, 16, 0.0),
                                                    (4, 2, 64, 1e-5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_equals_the_two_launches(device, batch, heads, dim, eps, dtype):
    """eps 0 with H = 5: the tile's three padding heads (rsqrt(0) * 0 = NaN there) must not reach the scale."""
    x, gate, weight = _inputs(batch, heads, dim, dtype, device)
    got = gated_rms_norm_quant(x, gate, weight, eps)
    assert got.dtype == dtype and got.lead == (batch,) and got.values is None
    _assert_same_bytes(got, _two_launches(x, gate, weight, eps))


@pytest.mark.parametrize("layout", ["contiguous", "strided_heads", "strided_rows"])
def test_reads_strided_gates(device, layout):
    """The same bytes whatever the gate's row and head strides (D contiguous)."""
    batch, heads, dim = 3, 3, 40
    x, z, weight = _inputs(batch, heads, dim, torch.bfloat16, device, seed=1)
    if layout == "contiguous":
        gate = z.contiguous()
    elif layout == "strided_heads":  # each head's first D of 2 * D, as a [B, H, 2 * D] projection would hold them
        wide = torch.randn(batch, heads, 2 * dim, device=device).to(torch.bfloat16)
        wide[..., :dim] = z
        gate = wide[..., :dim]
    else:
        gate = z
    assert gate.stride(2) == 1 and (layout == "contiguous") == gate.is_contiguous()
    want = _two_launches(x, z.contiguous(), weight, 1e-6)
    _assert_same_bytes(gated_rms_norm_quant(x, gate, weight, 1e-6), want)


def test_a_nan_stays_in_its_token(device):
    """A NaN in token 1's gate: its scale NaN (its codes are NaN on the GPU; the interpreter's cast makes them finite,
    the two-launch reference's too), every other token's bytes unchanged."""
    batch, heads, dim = 3, 3, 40
    x, gate, weight = _inputs(batch, heads, dim, torch.bfloat16, device, seed=2)
    clean = gated_rms_norm_quant(x, gate, weight, 1e-6)
    gate[1, 2, 7] = float("nan")
    got = gated_rms_norm_quant(x, gate, weight, 1e-6)
    assert torch.isnan(got.x_scale[1]).all() and not torch.isnan(got.x_scale[[0, 2]]).any()
    others = [0, 2]
    assert torch.equal(got.x_q[others].view(torch.uint8), clean.x_q[others].view(torch.uint8))
    assert torch.equal(got.x_scale[others], clean.x_scale[others])
    _assert_same_bytes(got, _two_launches(x, gate, weight, 1e-6))


def test_an_all_zero_token_takes_the_minimum_scale(device):
    batch, heads, dim = 2, 3, 40
    x, gate, weight = _inputs(batch, heads, dim, torch.bfloat16, device, seed=3)
    x[heads:] = 0  # token 1: all its heads
    got = gated_rms_norm_quant(x, gate, weight, 1e-6)
    assert got.x_scale[1, 0].item() == torch.tensor(MIN_SCALE, dtype=torch.float32).item()
    assert not got.x_q[1].view(torch.uint8).any()
    assert got.x_scale[0, 0].item() > MIN_SCALE
    _assert_same_bytes(got, _two_launches(x, gate, weight, 1e-6))


def test_no_tokens(device):
    x, gate, weight = _inputs(0, 4, 32, torch.bfloat16, device)
    got = gated_rms_norm_quant(x, gate, weight, 1e-6)
    assert got.x_q.shape == (0, 128) and got.x_scale.shape == (0, 1) and got.lead == (0,)


def test_refuses_bad_arguments(device):
    x, gate, weight = _inputs(2, 3, 40, torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"x \[B \* H, D\], gate \[B, H, D\]"):
        gated_rms_norm_quant(x, gate.reshape(6, 40), weight, 1e-6)  # a 2-D gate: H unknown
    with pytest.raises(ValueError, match=r"gate \[B, H, D\]"):
        gated_rms_norm_quant(x[:4], gate, weight, 1e-6)  # B * H != rows of x
    with pytest.raises(ValueError, match=r"weight \[D\]"):
        gated_rms_norm_quant(x, gate, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="must be contiguous"):
        gated_rms_norm_quant(x.t().contiguous().t(), gate, weight, 1e-6)
    with pytest.raises(ValueError, match="must be contiguous"):
        gated_rms_norm_quant(x, gate.transpose(1, 2).contiguous().transpose(1, 2), weight, 1e-6)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gated_rms_norm_quant(x.to(torch.float8_e4m3fn), gate, weight, 1e-6)
    with pytest.raises(ValueError, match=r"H \* D = 5 \* 4096 pads to a 8 x 4096 tile, over the 16384"):
        gated_rms_norm_quant(torch.zeros(5, 4096, device=device, dtype=torch.bfloat16),
                             torch.zeros(1, 5, 4096, device=device, dtype=torch.bfloat16),
                             torch.ones(4096, device=device, dtype=torch.bfloat16), 1e-6)
