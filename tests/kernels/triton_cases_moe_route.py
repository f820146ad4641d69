"""The one-launch routing kernel (moe_routing.route_tokens) against the torch ops it replaces. Run on CUDA, or on the
CPU through the Triton interpreter by test_triton_interpreter.py."""

import math

import pytest
import torch

from radiance.kernels import moe_routing as moe
from tests.kernels.test_moe_routing import check_routing


def _on_cpu(routing: moe.ExpertRouting) -> moe.ExpertRouting:
    return routing._replace(sorted_pairs=routing.sorted_pairs.cpu(), tile_expert=routing.tile_expert.cpu(),
                            group_ends=routing.group_ends.cpu())


def _torch_routing(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 128, 8), (3, 8, 2), (17, 60, 4), (64, 128, 8),
                                                      (200, 32, 4), (5, 4, 4)])
@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_tokens_kernel_matches_torch(device, tokens, num_experts, top_k, block_m, renormalize):
    logits = torch.randn(tokens, num_experts, device=device) * 3  # fp32: no ties
    weights, ids, routing = moe.route_tokens(logits, top_k, renormalize, block_m)
    want_weights, want_ids = _torch_routing(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(ids.long(), want_ids)
    routing = _on_cpu(routing)
    check_routing(routing, ids.long().cpu(), num_experts, block_m)
    used = routing.tile_expert >= 0
    assert routing.group_ends.tolist() == [int((used & (routing.tile_expert <= e)).sum()) * block_m
                                           for e in range(num_experts)]


def test_route_tokens_kernel_bf16_logits_with_ties(device):
    """bf16 logits, as a model's router gives them, tie often: the kernel takes the lower expert of a tie, so
    compare what ties cannot change: the weights in order, and each picked expert's own probability."""
    logits = (torch.randn(40, 128, device=device) * 3).to(torch.bfloat16)
    logits[0, 5] = logits[0, 9] = 30.0  # an exact tie at the top
    weights, ids, routing = moe.route_tokens(logits, 8, False, 16)
    want_weights, _ = _torch_routing(logits, 8, False)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    torch.testing.assert_close(weights, probs.gather(1, ids.long()), rtol=1e-5, atol=1e-7)
    assert ids[0, :2].tolist() == [5, 9]
    assert all(len(set(row)) == 8 for row in ids.tolist())
    check_routing(_on_cpu(routing), ids.long().cpu(), 128, 16)


def test_route_tokens_kernel_fp32_logits_and_strided(device):
    """fp32 logits as a column slice of a wider tensor (row stride != E)."""
    wide = torch.randn(9, 40, device=device)
    logits = wide[:, 4:36]
    weights, ids, routing = moe.route_tokens(logits, 3, False, 16)
    want_weights, want_ids = _torch_routing(logits, 3, False)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(ids.long(), want_ids)
    check_routing(_on_cpu(routing), ids.long().cpu(), 32, 16)


def test_route_tokens_falls_back_to_torch_above_the_kernel_band(device):
    logits = torch.randn(moe.ROUTE_KERNEL_MAX_TOKENS + 1, 16, device=device)
    weights, ids, routing = moe.route_tokens(logits, 2, True, 16)
    want_weights, want_ids = _torch_routing(logits, 2, True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights)
    check_routing(_on_cpu(routing), want_ids.cpu(), 16, 16)


@pytest.mark.parametrize("tokens,top_k,width", [(1, 8, 2048), (5, 2, 48), (33, 4, 1500)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_combine_experts_matches_torch(device, tokens, top_k, width, out_dtype):
    h = torch.randn(tokens * top_k, width, device=device).to(out_dtype)
    weights = torch.rand(tokens, top_k, device=device)
    out = moe.combine_experts(h, weights, out_dtype)
    want = (h.view(tokens, top_k, width).float() * weights[..., None]).sum(dim=1)
    assert out.dtype == out_dtype and out.shape == (tokens, width)
    torch.testing.assert_close(out.float(), want.to(out_dtype).float(), rtol=1e-5 if out_dtype == torch.float32
                               else 2 ** -7, atol=1e-5)


@pytest.mark.parametrize("tokens,valid", [(24, 9), (24, 0), (5, 5), (7, 30)])
@pytest.mark.parametrize("block_m", [1, 16])
def test_route_tokens_kernel_skips_padding_rows(device, tokens, valid, block_m):
    """valid_rows: the kernel lays out the slots exactly as the torch path does, the real rows grouped and the
    padding rows' pairs parked past the used tiles; weights and ids are still given for every row."""
    logits = torch.randn(tokens, 32, device=device) * 3
    count = torch.tensor([valid], dtype=torch.int32, device=device)
    weights, ids, routing = moe.route_tokens(logits, 4, True, block_m, count)
    want_weights, want_ids = _torch_routing(logits, 4, True)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(ids.long(), want_ids)
    want = moe.route_to_experts(want_ids, 32, block_m, count)
    routing = _on_cpu(routing)
    assert torch.equal(routing.sorted_pairs, want.sorted_pairs.cpu())
    assert torch.equal(routing.tile_expert, want.tile_expert.cpu())
    assert torch.equal(routing.group_ends, want.group_ends.cpu())
    check_routing(routing, want_ids.cpu(), 32, block_m, valid_rows=valid)


@pytest.mark.parametrize("with_rows", [False, True])
def test_combine_zeroes_padding_rows(device, with_rows):
    """The rows from valid_rows on are zeros, even where their (never written) expert outputs hold NaN."""
    tokens, top_k, width = 6, 2, 40
    h = torch.randn(tokens * top_k, width, device=device)
    h[8:] = float("nan")  # the pairs of rows 4 and 5
    weights = torch.rand(tokens, top_k, device=device)
    rows = torch.randperm(tokens * top_k, device=device).to(torch.int32) if with_rows else None
    source = h[rows.argsort()] if with_rows else h  # so that rows[p] reads pair p's output
    out = moe.combine_experts(source, weights, torch.float32, rows=rows,
                              valid_rows=torch.tensor([4], dtype=torch.int32, device=device))
    want = (h.view(tokens, top_k, width) * weights[..., None]).sum(dim=1)
    torch.testing.assert_close(out[:4], want[:4], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 128, 8), (2, 128, 8), (8, 128, 8), (3, 60, 6), (2, 32, 4)])
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("valid", [None, 0, 1])
def test_one_block_routing_equals_the_blocked_one(device, monkeypatch, tokens, num_experts, top_k, block_m, valid):
    """Decode-sized routings (all pairs in one block) keep their phases in registers: the same ids and slot layout as
    the general path, which hands them over through global memory, and as the torch path; the same weights but for
    the renormalization's rounding."""
    logits = torch.randn(tokens, num_experts, device=device) * 3
    count = None if valid is None else torch.tensor([valid], dtype=torch.int32, device=device)
    results = []
    for one_block in (False, True):
        monkeypatch.setattr(moe, "ROUTE_ONE_BLOCK", one_block)
        weights, ids, routing = moe.route_tokens(logits, top_k, True, block_m, count)
        results.append((weights, ids, routing.sorted_pairs, routing.tile_expert, routing.group_ends))
    (weights_blocked, *blocked), (weights_one, *one) = results
    # the renormalizing sum runs over registers of another layout (4 warps from 3 tokens): last-ulp differences
    torch.testing.assert_close(weights_one, weights_blocked, rtol=1e-6, atol=0)
    for got, want in zip(one, blocked):
        assert torch.equal(got, want)
    want = moe.route_to_experts(ids.long(), num_experts, block_m, count)
    routing = _on_cpu(routing)
    assert torch.equal(routing.sorted_pairs, want.sorted_pairs.cpu())
    assert torch.equal(routing.tile_expert, want.tile_expert.cpu())
    check_routing(routing, ids.long().cpu(), num_experts, block_m, valid_rows=valid)


def test_one_block_ties_go_to_the_lower_expert(device):
    """Exact ties at the top of decode-sized routings (the one-block path): the lower expert first, as torch's path."""
    logits = (torch.randn(2, 128, device=device) * 3).to(torch.bfloat16)
    logits[0, 5] = logits[0, 9] = 30.0
    logits[1, 70] = logits[1, 3] = 30.0
    _, ids, _ = moe.route_tokens(logits, 8, False, 16)
    assert ids[:, :2].tolist() == [[5, 9], [3, 70]]


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_zero_probabilities_rank_by_expert_and_never_pick_padding(device, tokens):
    """Experts whose probability underflows to exactly 0 still fill a token's top_k, lowest expert first, and the
    padding experts past E (60 of E_PAD 64, probability 0 too) are never picked: the top-k step orders the
    probability's bits, then the expert."""
    logits = torch.full((tokens, 60), -1000.0, device=device)
    logits[:, 50] = 0.0
    logits[:, 7] = -1.0
    weights, ids, routing = moe.route_tokens(logits, 8, True, 16)
    assert ids.tolist() == [[50, 7, 0, 1, 2, 3, 4, 5]] * tokens
    want = torch.tensor([1.0, math.exp(-1.0), 0, 0, 0, 0, 0, 0]) / (1.0 + math.exp(-1.0))
    torch.testing.assert_close(weights.cpu(), want.expand(tokens, 8), rtol=1e-6, atol=0)
    check_routing(_on_cpu(routing), ids.long().cpu(), 60, 16)


@pytest.mark.parametrize("tokens,num_experts", [(1, 16), (7, 16), (40, 128)])
def test_one_renormalized_expert_weighs_exactly_one(device, tokens, num_experts):
    """Llama 4 routes each token to one expert and scales that expert's input by the router's sigmoid score
    instead (SparseMoeBlock.input_scales): the renormalized top-1 weight the combine multiplies by must be 1
    exactly, with the top logit's expert picked."""
    logits = (torch.randn(tokens, num_experts, device=device) * 3).to(torch.bfloat16)
    weights, ids, _ = moe.route_tokens(logits, 1, True, 16)
    assert torch.equal(weights.cpu(), torch.ones(tokens, 1))
    assert torch.equal(logits.float().gather(1, ids.long()).squeeze(1), logits.float().max(dim=1).values)


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 128, 8), (3, 8, 2), (8, 128, 8), (17, 60, 4), (200, 32, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("one_block", [True, False])
def test_sigmoid_routing_with_a_correction_bias_is_the_torch_pick(device, monkeypatch, tokens, num_experts, top_k,
                                                                  renormalize, one_block):
    """GLM-4.5's router in the kernel (one expert group): experts picked by sigmoid + a bias of either sign, weighed
    by the unbiased score, renormalized or not, times the routed scaling: grouped_sigmoid_top_k's ids and weights
    (in its order: the kernel's argmax steps pick by descending key too), and the slot layout of its ids."""
    monkeypatch.setattr(moe, "ROUTE_ONE_BLOCK", one_block)
    gen = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, num_experts, generator=gen) * 3).to(device)
    bias = (torch.randn(num_experts, generator=gen) * 0.5).to(device)
    count = torch.tensor([max(tokens - 1, 0)], dtype=torch.int32, device=device) if tokens > 2 else None
    weights, ids, routing = moe.route_tokens(logits, top_k, renormalize, 16, count, correction_bias=bias, scaling=2.5)
    want_weights, want_ids = moe.grouped_sigmoid_top_k(logits, bias, top_k, 1, 1, renormalize, 2.5)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    check_routing(_on_cpu(routing), ids.long().cpu(), num_experts, 16, valid_rows=None if count is None else int(count))
