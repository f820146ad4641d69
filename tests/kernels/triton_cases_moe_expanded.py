"""The prefill path of W4A8 experts: every expert expanded to e4m3 in one launch, then an fp8 grouped GEMM over
expert-sorted rows (moe.w4a8_moe_mm_expanded) vs the exact reference, experts without rows, every row on one
expert, then read back in pair order with the expert biases by combine_experts. Run on CUDA (torch._scaled_grouped_mm, bf16 out), or on the CPU
through the Triton interpreter by test_triton_interpreter.py (the expansion kernel; the grouped GEMM is its
fp32 torch equivalent there)."""

import pytest
import torch

from radiance.kernels.moe import expert_weight, w4a8_moe_reference
from radiance.kernels.moe_expanded import expand_experts_fp8, w4a8_moe_mm_expanded
from radiance.kernels.moe_routing import combine_experts, expert_of_rows, pair_rows, route_to_experts
from radiance.kernels.reference import relative_error
from radiance.kernels.w4a8 import expand_weight_fp8
from tests.kernels.triton_cases_moe import GATE, moe_inputs, random_experts
from tests.kernels.triton_cases_moe_bias import expert_biases

# bf16 output on CUDA (torch's fp8 grouped GEMM returns bf16): one rounding, ~1.5e-3 rms relative on its own
BF16_GATE = 5e-3


@pytest.mark.parametrize("num_experts,n,k", [(3, 48, 160), (2, 64, 256)])  # K = 160: a ragged 128-k group
def test_expanding_every_expert_gives_each_experts_bytes(device, num_experts, n, k):
    experts = random_experts(device, num_experts, n, k)
    poisoned = torch.full((num_experts, n, k), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    got = expand_experts_fp8(experts, out=poisoned)
    assert got.shape == (num_experts, n, k)
    for e in range(num_experts):
        want = expand_weight_fp8(expert_weight(experts, e))
        assert torch.equal(got[e].view(torch.uint8), want.view(torch.uint8)), f"expert {e}"


def test_expert_of_rows_follows_the_group_ends(device):
    ends = torch.tensor([2, 2, 5, 9], dtype=torch.int32, device=device)  # expert 1 has no rows
    assert expert_of_rows(ends, 9).tolist() == [0, 0, 2, 2, 2, 3, 3, 3, 3]


# (T, top_k, E, N, K, rows per pair source, routing pattern)
CASES = [
    (9, 2, 4, 48, 160, "token", "random"),
    (33, 4, 6, 112, 256, "token", "skip"),  # experts 0 and 5 without rows
    (17, 2, 3, 64, 128, "pair", "same"),  # every token's first choice on one expert
    (1, 1, 3, 32, 96, "pair", "random"),  # one row
]


@pytest.mark.parametrize("tokens,top_k,num_experts,n,k,source,pattern", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_expanded_grouped_gemm_matches_reference(device, tokens, top_k, num_experts, n, k, source, pattern):
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, n, k, source, pattern)
    routing = route_to_experts(ids, num_experts, 1)
    order = routing.sorted_pairs.long()
    rows = order // top_k if source == "token" else order
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sorted_out = w4a8_moe_mm_expanded(x_q.view(torch.uint8)[rows].view(x_q.dtype), x_scale[rows], experts,
                                      routing.group_ends, out_dtype=out_dtype)
    assert sorted_out.dtype == out_dtype and sorted_out.shape == (tokens * top_k, n)
    out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)  # back in pair order
    ref = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source=source, out_dtype=torch.float32)
    err = relative_error(out, ref)
    assert err <= (BF16_GATE if out_dtype == torch.bfloat16 else GATE), f"rel {err:.2e}"


@pytest.mark.parametrize("with_bias", [False, True])
def test_combine_reads_sorted_rows_in_place_with_their_biases(device, with_bias):
    """combine_experts over expert-sorted rows (pair_rows) with each pair's expert bias equals combining the
    rows put back in pair order with the bias added (torch)."""
    tokens, top_k, num_experts, width = 13, 3, 5, 96
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).to(device)
    routing = route_to_experts(ids, num_experts, 1)
    h_sorted = torch.randn(tokens * top_k, width, device=device)
    weights = torch.rand(tokens, top_k, device=device)
    bias = expert_biases(device, num_experts, width) if with_bias else None
    got = combine_experts(h_sorted, weights, torch.float32, rows=pair_rows(routing.sorted_pairs, routing.num_pairs),
                          bias=bias, ids=ids.to(torch.int32) if with_bias else None)
    h = torch.empty_like(h_sorted).index_copy_(0, routing.sorted_pairs.long(), h_sorted)
    if with_bias:
        h = h + bias[ids.reshape(-1)]
    want = (h.view(tokens, top_k, width) * weights[..., None]).sum(dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_expanded_grouped_gemm_rejects_mismatched_operands(device):
    x_q, x_scale, experts, ids = moe_inputs(device, 4, 2, 3, 48, 160, "pair")
    routing = route_to_experts(ids, 3, 1)
    with pytest.raises(ValueError, match="group ends for 3 experts of K=160"):
        w4a8_moe_mm_expanded(x_q[:, :128], x_scale, experts, routing.group_ends)
    with pytest.raises(ValueError, match="multiples of 16"):
        w4a8_moe_mm_expanded(*moe_inputs(device, 4, 2, 3, 40, 160, "pair")[:3], routing.group_ends)
