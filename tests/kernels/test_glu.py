"""glu.glu_reference against HF transformers' gpt-oss expert code (transcribed) and against values worked out
by hand, clamps included."""

import math

import pytest
import torch
import torch.nn.functional as F

from radiance.kernels.glu import GLU_KINDS, SILU, GluActivation, glu_reference

SWIGLU = GluActivation("swiglu_oai")


def hf_gpt_oss_glu(gate_up_interleaved: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """transformers' GptOssExperts.forward between its two GEMMs, on its checkpoint's alternating gate / up
    columns (the loader de-interleaves them into radiance's [gate | up])."""
    gate, up = gate_up_interleaved[..., ::2], gate_up_interleaved[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] in [gate | up] order -> gpt-oss's alternating gate, up columns."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_swiglu_oai_is_hf_gpt_oss_bit_for_bit(dtype):
    gate_up = (torch.randn(6, 2, 2 * 40) * 8).to(dtype)  # many |gate|, |up| beyond the limit 7
    gate, up = gate_up.chunk(2, dim=-1)
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any()
    got = glu_reference(gate_up, SWIGLU)
    assert got.dtype == dtype and got.shape == (6, 2, 40)
    assert torch.equal(got, hf_gpt_oss_glu(interleave(gate_up)))


def test_swiglu_oai_clamps_by_hand():
    """gate clamped above only, up on both sides; alpha and limit taken from the activation."""
    gate = [10.0, -10.0, 0.5, 3.0, 3.0]
    up = [20.0, -20.0, 0.3, -1.0, 2.5]
    act = GluActivation("swiglu_oai", alpha=1.5, limit=2.0)

    def formula(g, u):
        g, u = min(g, 2.0), max(min(u, 2.0), -2.0)
        return (u + 1) * g / (1 + math.exp(-1.5 * g))

    want = torch.tensor([formula(g, u) for g, u in zip(gate, up)], dtype=torch.float64)
    got = glu_reference(torch.tensor(gate + up, dtype=torch.float64), act)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_swiglu_oai_keeps_nan_and_defaults_to_gpt_oss():
    assert (SWIGLU.alpha, SWIGLU.limit) == (1.702, 7.0)
    got = glu_reference(torch.tensor([float("nan"), 1.0, 2.0, float("nan")]), SWIGLU)
    assert got.isnan().all()  # torch.clamp keeps NaN: a NaN gate or up stays NaN


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_silu_is_silu_mul(dtype):
    gate_up = torch.randn(3, 64).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(glu_reference(gate_up, SILU), F.silu(gate) * up)


def test_kinds_and_kernel_codes():
    assert SILU == GluActivation("silu") and SILU.kind == "silu"
    assert [GluActivation(kind).kernel_code for kind in GLU_KINDS] == [0, 1, 2]
    with pytest.raises(ValueError, match="kind must be one of"):
        GluActivation("gelu")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_gelu_tanh_is_gemmas_geglu(dtype):
    """Gemma's MLP: transformers' gelu_pytorch_tanh of the gate times the up projection, in the input dtype."""
    from transformers.activations import ACT2FN

    gate_up = (torch.randn(4, 96) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(glu_reference(gate_up, GluActivation("gelu_tanh")), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert GluActivation("gelu_tanh").kernel_constexprs() == {"ACT": 2}
