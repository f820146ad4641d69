"""The grouped W4A8 GEMM with gpt-oss's per-expert biases and clamped SwiGLU (glu.GluActivation) vs its
exact reference, in both tilings. Run on CUDA, or on the CPU through the Triton interpreter by
test_triton_interpreter.py (fp32 outputs there: see triton_cases_gemm's GATE note); bf16 on CUDA only."""

import pytest
import torch

from radiance.kernels.glu import SILU, GluActivation, glu_reference
from radiance.kernels.moe import w4a8_moe_gemm, w4a8_moe_reference
from radiance.kernels.moe_routing import route_to_experts
from radiance.kernels.reference import quantize_activations_reference, relative_error
from tests.kernels.triton_cases_moe import GATE, TILINGS, assert_close_quantized_rows, moe_inputs, routed

SWIGLU = GluActivation("swiglu_oai")
ACTIVATIONS = {"silu": SILU, "swiglu_oai": SWIGLU}


def expert_biases(device, num_experts: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """[E, N], as large as the GEMM's outputs here (std 3-8), so that a missing bias or another expert's
    fails the checks, and that with them many gates and ups pass swiglu_oai's clamps (|v| > 7)."""
    return (torch.randn(num_experts, n, device=device) * 4).to(dtype)


def assert_bias_matters(with_bias: torch.Tensor, without_bias: torch.Tensor):
    """The case can fail: a kernel that dropped the bias would be far outside the gate."""
    assert relative_error(without_bias, with_bias) > 100 * GATE


# (T, top_k, E, N, K, tiling, bias dtype): the down GEMM (one activation row per pair)
DOWN_CASES = [
    (5, 2, 4, 112, 160, "swap16", torch.float32),
    (70, 2, 4, 48, 160, "plain64", torch.bfloat16),
]


@pytest.mark.parametrize("tokens,top_k,num_experts,n,k,tiling,bias_dtype", DOWN_CASES,
                         ids=["-".join(map(str, c)) for c in DOWN_CASES])
def test_grouped_gemm_adds_each_experts_bias(device, tokens, top_k, num_experts, n, k, tiling, bias_dtype):
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, n, k, "pair", "skip")
    bias = expert_biases(device, num_experts, n, bias_dtype)
    out = torch.full((tokens * top_k, n), float("nan"), device=device)  # poisoned
    w4a8_moe_gemm(x_q, x_scale, experts, routed(ids, num_experts, tiling), rows_per_pair_source="pair",
                  out_dtype=torch.float32, config=TILINGS[tiling], out=out, bias=bias)
    ref = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source="pair", out_dtype=torch.float32,
                             bias=bias)
    err = relative_error(out, ref)
    assert err <= GATE, f"{tiling}: rel {err:.2e}"
    assert_bias_matters(ref, w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source="pair",
                                                out_dtype=torch.float32))


def assert_clamps_matter(gate_up: torch.Tensor, act: GluActivation):
    """Some gates pass the limit, some ups pass it on either side, and the clamps change the output."""
    gate, up = gate_up.chunk(2, dim=-1)
    assert (gate > act.limit).any() and (up > act.limit).any() and (up < -act.limit).any()
    unclamped = GluActivation(act.kind, act.alpha, limit=float("inf"))
    assert relative_error(glu_reference(gate_up, unclamped), glu_reference(gate_up, act)) > 100 * GATE


# (T, top_k, E, I, K, tiling, activation): the gate_up GEMM (one activation row per token), N = 2I rows
GLU_CASES = [
    (5, 2, 4, 56, 160, "swap16", "silu"),
    (70, 2, 4, 24, 160, "plain64", "silu"),
    (9, 4, 8, 56, 416, "swap16", "swiglu_oai"),
    (70, 2, 4, 24, 160, "plain64", "swiglu_oai"),
    (64, 2, 8, 24, 256, "default64", "swiglu_oai"),
    (140, 2, 4, 24, 416, "default128", "swiglu_oai"),
]


@pytest.mark.parametrize("tokens,top_k,num_experts,inter,k,tiling,act_name", GLU_CASES,
                         ids=["-".join(map(str, c)) for c in GLU_CASES])
def test_grouped_glu_with_bias(device, tokens, top_k, num_experts, inter, k, tiling, act_name):
    """The activation rows before quantization against glu_reference of the reference GEMM + bias, and the
    quantized rows against w4a8_moe_reference."""
    act = ACTIVATIONS[act_name]
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, 2 * inter, k, "token")
    bias = expert_biases(device, num_experts, 2 * inter)
    y = torch.full((tokens * top_k, inter), float("nan"), device=device)  # poisoned
    got = w4a8_moe_gemm(x_q, x_scale, experts, routed(ids, num_experts, tiling), rows_per_pair_source="token",
                        glu=True, out_dtype=torch.float32, config=TILINGS[tiling], out=y, bias=bias, activation=act)
    reference = dict(rows_per_pair_source="token", out_dtype=torch.float32, bias=bias)
    gate_up = w4a8_moe_reference(x_q, x_scale, experts, ids, **reference)
    err = relative_error(y, glu_reference(gate_up, act))
    assert err <= GATE, f"{tiling} {act_name}: rel {err:.2e}"
    assert_close_quantized_rows(device, got,
                                w4a8_moe_reference(x_q, x_scale, experts, ids, glu=True, activation=act, **reference))
    if act.kind == "swiglu_oai":
        assert_clamps_matter(gate_up, act)
    without_bias = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source="token",
                                      out_dtype=torch.float32)
    assert_bias_matters(glu_reference(gate_up, act), glu_reference(without_bias, act))


@pytest.mark.parametrize("tiling", ("swap16", "default64"))
def test_bf16_swiglu_epilogue_is_glu_reference_of_the_gemm(device, tiling):
    """On CUDA the GLU tile sums each gate and up as the plain tile does (the same bytes), so the fused
    epilogue's bf16 rows are glu_reference of the plain GEMM's bf16 output with its bias, but where Triton's
    exp and torch's sigmoid round differently: one bf16 step, on few elements. Rounding in another order
    (e.g. the whole activation in fp32) moves many more. The interpreter rounds fp32 to bf16 by truncation."""
    if device.type != "cuda":
        pytest.skip("bf16 rounding: CUDA only")
    tokens, top_k, num_experts, inter, k = 40, 4, 8, 256, 512
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, 2 * inter, k, "token")
    bias = expert_biases(device, num_experts, 2 * inter, torch.bfloat16)
    routing = route_to_experts(ids, num_experts, 16 if tiling == "swap16" else 64)
    launch = dict(rows_per_pair_source="token", out_dtype=torch.bfloat16, config=TILINGS[tiling], bias=bias)
    gate_up = w4a8_moe_gemm(x_q, x_scale, experts, routing, **launch)
    y = torch.empty((tokens * top_k, inter), device=device, dtype=torch.bfloat16)
    got = w4a8_moe_gemm(x_q, x_scale, experts, routing, glu=True, out=y, activation=SWIGLU, **launch)
    want = glu_reference(gate_up, SWIGLU)
    assert_clamps_matter(gate_up.float(), SWIGLU)
    assert (y != want).float().mean() <= 0.01
    steps = 4 * torch.finfo(torch.bfloat16).eps  # a sigmoid a step off moves the two products after it
    torch.testing.assert_close(y, want, rtol=steps, atol=0)
    want_q, want_s = quantize_activations_reference(want)
    torch.testing.assert_close(got[1], want_s, rtol=steps, atol=0)
    assert (got[0].view(torch.uint8) != want_q.view(torch.uint8)).float().mean() <= 0.01


def test_bias_shape_is_checked(device):
    x_q, x_scale, experts, ids = moe_inputs(device, 3, 2, 4, 48, 96, "token")
    routing = route_to_experts(ids, 4, 16)
    with pytest.raises(ValueError, match=r"bias must be \[4, 48\]"):
        w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="token", bias=torch.zeros(48))
