"""route_to_experts, the expert stack and the grouped GEMM's reference, in plain torch on the CPU (the
kernel itself: triton_cases_moe.py)."""

import pytest
import torch

from radiance.kernels.activation import quantize_activations
from radiance.kernels.moe import expert_weight, moe_block_m, stack_experts, w4a8_moe_reference
from radiance.kernels.moe_routing import ExpertRouting, max_slots, route_to_experts
from radiance.kernels.prepare import dequantize_prepared, prepare_mxfp4
from radiance.kernels.reference import quantize_activations_reference
from tests.kernels.conftest import random_mxfp4


def check_routing(routing: ExpertRouting, topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  valid_rows: int | None = None):
    """Every property the grouped GEMM relies on; with valid_rows, that only the first valid_rows tokens have
    slots in the used tiles and the later pairs are parked right after them, in pair order."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    routed = pairs if valid_rows is None else min(valid_rows, tokens) * top_k
    expert_of_pair = topk_ids.reshape(-1)[:routed]
    slots, tile_expert = routing.sorted_pairs, routing.tile_expert
    assert (routing.num_pairs, routing.top_k, routing.block_m) == (pairs, top_k, block_m)
    assert slots.dtype == torch.int32 and tile_expert.dtype == torch.int32
    assert slots.shape == (max_slots(pairs, num_experts, block_m),) and slots.numel() % block_m == 0
    assert tile_expert.shape == (slots.numel() // block_m,)
    live = slots < pairs
    assert torch.equal(slots[~live], torch.full_like(slots[~live], pairs))  # padding holds num_pairs
    assert torch.equal(slots[live].sort().values, torch.arange(pairs, dtype=torch.int32))  # each pair once
    # used tiles first, in expert order, then -1
    used = int((tile_expert >= 0).sum())
    assert (tile_expert[used:] == -1).all() and (tile_expert[:used].diff() >= 0).all()
    parked = slots[used * block_m:used * block_m + pairs - routed]
    assert torch.equal(parked, torch.arange(routed, pairs, dtype=torch.int32))
    assert not live[used * block_m + pairs - routed:].any()
    live[used * block_m:] = False
    slot_expert = tile_expert.repeat_interleave(block_m)
    assert torch.equal(slot_expert[live].long(), expert_of_pair[slots[live].long()].long())  # the tile's expert
    for e in range(num_experts):
        count = int((expert_of_pair == e).sum())
        tiles = torch.nonzero(tile_expert == e).flatten()
        assert len(tiles) == -(-count // block_m)  # padded to whole tiles, no empty tile
        if count:
            group = slots[int(tiles[0]) * block_m:(int(tiles[-1]) + 1) * block_m]
            assert live[int(tiles[0]) * block_m:][:count].all() and not (group[count:] < pairs).any()
            assert (group[:count].diff() > 0).all()  # the pairs keep their order (stable)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 1, 1), (1, 8, 128), (2, 2, 4), (5, 4, 8), (17, 1, 8),
                                                      (64, 2, 4), (300, 8, 128)])
def test_random_routing(tokens, top_k, num_experts, block_m):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    check_routing(route_to_experts(ids, num_experts, block_m), ids, num_experts, block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_edge_routings(block_m):
    cases = [
        torch.full((70, 1), 3),  # every token on the same expert, several tiles
        torch.full((5, 2), 7),  # the same expert twice per token, the last expert
        torch.arange(8).reshape(1, 8),  # every expert one pair: the most padding the bound allows
        torch.tensor([[2, 5], [5, 2], [2, 5]]),  # experts 0, 1, 3, 4, 6, 7 get nothing
        torch.zeros((0, 4), dtype=torch.int64),  # no tokens
        torch.full((16, 1), 0, dtype=torch.int32),  # exactly one full tile, int32 ids
    ]
    for ids in cases:
        routing = route_to_experts(ids, 8, block_m)
        check_routing(routing, ids.long(), 8, block_m)


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("tokens,valid", [(40, 25), (40, 0), (40, 40), (40, 99), (3, 1)])
def test_padding_rows_get_no_expert(block_m, tokens, valid):
    """A graph's padding rows (from valid_rows on; a count above the rows means all) route to no expert: the
    groups hold the real rows' pairs alone, which route as they would on their own, and a padding pair sits
    past the used tiles."""
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(tokens)])
    ids[valid:] = 3  # padding rows of one bucket all pick the same experts
    routing = route_to_experts(ids, 16, block_m, torch.tensor([valid], dtype=torch.int32))
    check_routing(routing, ids, 16, block_m, valid_rows=valid)
    alone = route_to_experts(ids[:valid], 16, block_m)
    real = min(valid, tokens)
    assert torch.equal(routing.group_ends, alone.group_ends)
    used = int(routing.group_ends[-1])
    assert torch.equal(routing.sorted_pairs[:used], torch.where(alone.sorted_pairs[:used] == real * 4,
                                                                tokens * 4, alone.sorted_pairs[:used]))


def test_routing_is_the_expected_layout():
    ids = torch.tensor([[1, 0], [1, 2], [0, 1]])  # pairs 0..5 -> experts 1 0 1 2 0 1
    routing = route_to_experts(ids, 4, 4)
    # max_slots: 6 pairs + min(4 experts, 6) * 3 padding = 18, rounded up to 20
    assert routing.sorted_pairs.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6] + [6] * 8
    assert routing.tile_expert.tolist() == [0, 1, 2, -1, -1]


def test_block_m_choice():
    # Qwen3-30B-A3B (128 experts, top 8): 16-slot tiles to 383 tokens, 64-slot from 384 (24 pairs per expert),
    # 128-slot from 1024 (64)
    assert moe_block_m(1 * 8, 128) == 16 and moe_block_m(383 * 8, 128) == 16
    assert moe_block_m(384 * 8, 128) == 64 and moe_block_m(1023 * 8, 128) == 64
    assert moe_block_m(1024 * 8, 128) == 128
    assert moe_block_m(0, 4) == 16
    assert moe_block_m(511 * 4, 32) == 64 and moe_block_m(512 * 4, 32) == 128  # gpt-oss-20b (32, top 4)


def test_stack_and_view_round_trip():
    weights = [prepare_mxfp4(*random_mxfp4(48, 160, "cpu")) for _ in range(3)]
    experts = stack_experts(weights)
    assert experts.shape == (3, 48, 160) and experts.w_shift.shape == (3, 2, 48, 4)
    assert experts.underflow_blocks == sum(w.underflow_blocks for w in weights)
    for e, w in enumerate(weights):
        assert torch.equal(dequantize_prepared(expert_weight(experts, e)), dequantize_prepared(w))
    with pytest.raises(ValueError, match="different shapes"):
        stack_experts([weights[0], prepare_mxfp4(*random_mxfp4(32, 160, "cpu"))])


@pytest.mark.parametrize("source", ["token", "pair"])
def test_reference_is_per_pair_matmul(source):
    """w4a8_moe_reference row p: x row (p // top_k or p) times its expert's dequantized weight."""
    experts = stack_experts([prepare_mxfp4(*random_mxfp4(40, 96, "cpu")) for _ in range(4)])
    ids = torch.tensor([[3, 1], [1, 0], [3, 0]])
    rows = 3 if source == "token" else 6
    x_q, x_scale = quantize_activations(torch.randn(rows, 96))
    out = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source=source, out_dtype=torch.float32)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        r = p // 2 if source == "token" else p
        want = (x_q[r].float() * x_scale[r]) @ dequantize_prepared(expert_weight(experts, e)).t()
        torch.testing.assert_close(out[p], want, rtol=1e-5, atol=1e-5)
    y_q, y_s = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source=source, glu=True,
                                  out_dtype=torch.float32)
    gate, up = out.split(20, dim=-1)
    want_q, want_s = quantize_activations_reference(torch.nn.functional.silu(gate) * up)
    assert torch.equal(y_s, want_s) and torch.equal(y_q.view(torch.uint8), want_q.view(torch.uint8))


def test_torch_combine_zeroes_padding_rows():
    from radiance.kernels.moe_routing import combine_experts
    h = torch.randn(10, 6)
    h[6:] = float("nan")  # rows 3 and 4's pairs: never written
    weights = torch.rand(5, 2)
    out = combine_experts(h, weights, torch.float32, valid_rows=torch.tensor([3]))
    torch.testing.assert_close(out[:3], (h[:6].view(3, 2, 6) * weights[:3, :, None]).sum(dim=1))
    assert torch.equal(out[3:], torch.zeros(2, 6))
