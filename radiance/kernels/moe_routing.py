"""Routing of mixture-of-experts pairs, and the way back: a pair p = token * top_k + choice.

route_to_experts / route_tokens group the pairs by expert into slots, each group padded to a multiple of
block_m, so that one block_m-slot tile of the grouped GEMM (moe.py) serves one expert. Their shapes follow from
(tokens, top_k, experts, block_m) alone and they never sync with the host, so a CUDA graph can capture them.
combine_experts sums each token's expert outputs, weighted by the router.

`valid_rows` (a device int tensor, element 0; None: every row) is the count of real tokens of a step replayed
from a CUDA graph padded to its bucket: the padding rows after them get no expert (their pairs are parked in
the slots past the used tiles, so the slots still hold each pair once) and combine to zeros. Without it a
bucket's padding costs the expert GEMMs as many pairs as real tokens would.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radiance.kernels._triton import moe_combine as _combine
from radiance.kernels._triton import moe_route as _route
from radiance.kernels._triton import moe_router as _router
from radiance.kernels.buffers import device_buffer
from radiance.kernels.device_info import supports_pdl
from radiance.kernels.triton_support import next_pow2, triton_serves


class ExpertRouting(NamedTuple):
    """Pairs grouped by expert (route_to_experts)."""

    sorted_pairs: torch.Tensor  # int32 [max_slots]: slot -> pair; padding slots hold num_pairs
    tile_expert: torch.Tensor  # int32 [max_slots / block_m]: expert of each tile, -1 past the used ones
    num_pairs: int  # T * top_k
    top_k: int
    block_m: int
    group_ends: torch.Tensor  # int32 [E]: one past each expert's last slot (with block_m 1: torch._grouped_mm's offs)


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for any routing of num_pairs pairs: each expert that gets a pair (at most min(E, pairs) of them)
    pads its group by at most block_m - 1; rounded up to whole tiles."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def route_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     valid_rows: torch.Tensor | None = None) -> ExpertRouting:
    """Group the pairs of topk_ids (int [T, top_k], ids in [0, num_experts)) by expert, on its device.
    Torch ops of fixed shapes, no host sync: CUDA-graph capturable. Within an expert's group the pairs keep
    their order (a stable sort), and its group starts at a multiple of block_m. With valid_rows only the
    first valid_rows[0] tokens are grouped; the later pairs are parked past the used tiles, in pair order."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    device = topk_ids.device
    slots = max_slots(num_pairs, num_experts, block_m)
    if valid_rows is not None:  # a padding row's pairs go to expert E: sorted last, given no tile
        real = torch.arange(tokens, device=device)[:, None] < valid_rows.reshape(-1)[:1]
        topk_ids = torch.where(real, topk_ids, num_experts)
    expert_of_pair = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    tiles = (counts[:num_experts] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)  # one past each expert's last tile
    # first slot of each expert's group, and of the parked pairs' after them (past the last group)
    group_start = torch.nn.functional.pad(tile_end, (1, 0)) * block_m
    pair_start = torch.cumsum(counts, 0) - counts  # first position of each expert in the sorted pairs
    order = torch.argsort(expert_of_pair, stable=True)  # pairs by expert
    sorted_expert = expert_of_pair[order]
    rank = torch.arange(num_pairs, device=device) - pair_start[sorted_expert]  # position within the group
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, group_start[sorted_expert] + rank, order.to(torch.int32))
    # tile i belongs to the first expert whose groups end after it (empty experts end where they start)
    tile_expert = torch.searchsorted(tile_end, torch.arange(slots // block_m, device=device), right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    group_ends = (tile_end * block_m).to(torch.int32)
    return ExpertRouting(sorted_pairs, tile_expert, num_pairs, top_k, block_m, group_ends)


# Tokens up to which route_tokens runs its one-program Triton kernel (decode and small prefills); above,
# torch's parallel sort wins over one program walking every pair. Qwen3-30B-A3B's router (128 experts, top 8)
# on the H200, us per call: kernel 4.7 / 11.3 / 40.6 / 75.4 / 146 at 1 / 8 / 64 / 128 / 256 tokens, torch ops
# 61 / 66 / 94 at 1 / 8 / 64 (bench/RESULTS.md, twenty-second session)
ROUTE_KERNEL_MAX_TOKENS = 128
# Up to this many tokens the routing kernel runs one warp (its barriers and reductions then stay in the warp:
# 4.7 against 6.4 us with 4 warps at one token); from 4 tokens on 4 warps are as fast or faster
ROUTE_ONE_WARP_MAX_TOKENS = 2
# Whether a routing whose tokens and pairs fit one tile and one block (decode: up to 8 tokens of top 8) keeps its
# phases in registers (moe_route._route_one_block) instead of handing them over through global memory
ROUTE_ONE_BLOCK = True


# Tokens up to which router_logits runs its Triton GEMV instead of torch's linear (cuBLAS). H200, us per call
# (graphs of 16 layers' weights), cuBLAS / GEMV: gpt-oss-20b (32 x 2880, bias) 5.4 / 2.3 at 1 token, 5.9 / 2.8 at
# 8; Qwen3-30B-A3B (128 x 2048) 4.7 / 1.6 and 5.0 / 2.5; Qwen3-235B-A22B (128 x 4096) 5.8 / 2.4, 5.9 / 3.8, and
# 6.0 / 6.6 at 16 tokens (bench/RESULTS.md, twenty-seventh session)
ROUTER_KERNEL_MAX_TOKENS = 8


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The router's logits [T, E] = x [T, H] @ weight [E, H]^T (+ bias) in x's dtype, as torch's linear computes
    them (fp32 sums, one rounding). Up to ROUTER_KERNEL_MAX_TOKENS tokens where Triton serves: one launch that
    takes part in programmatic dependent launch (cuBLAS's one or two do not); torch's linear otherwise."""
    tokens, hidden = x.shape
    if not (triton_serves(x) and 0 < tokens <= ROUTER_KERNEL_MAX_TOKENS) or x.stride(1) != 1 or weight.stride(1) != 1:
        return torch.nn.functional.linear(x, weight, bias)
    num_experts = weight.shape[0]
    out = torch.empty((tokens, num_experts), dtype=x.dtype, device=x.device)
    # one expert row per program, read in at most a few wide chunks: the loads are all in flight at once
    block_t = max(2, min(4, next_pow2(tokens)))
    pdl = supports_pdl(x.device)
    _router.moe_router_kernel[(num_experts, -(-tokens // block_t))](
        x, weight, bias if bias is not None else weight, out, tokens, num_experts, hidden, x.stride(0),
        weight.stride(0), out.stride(0), BT=block_t, BE=1, BH=min(2048, next_pow2(hidden)),
        HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def top_k_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) in torch ops: softmax of the router logits in fp32,
    its top_k, renormalized to sum to 1 with `renormalize` (what route_tokens' kernel computes)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_top_k(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int,
                          top_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) of GLM-4.5's / DeepSeek-V3's router in torch ops of
    fixed shapes (CUDA-graph capturable): sigmoid scores; the `top_groups` of `groups` expert groups whose two best
    scores + correction_bias sum highest; in them the top_k experts by score + bias; their unbiased scores,
    renormalized to sum to 1 with `renormalize`, times `scaling` (transformers' Glm4MoeTopkRouter)."""
    scores = torch.sigmoid(router_logits.float())
    biased = scores + correction_bias.float()
    tokens, experts = biased.shape
    if groups > 1:
        group_scores = biased.view(tokens, groups, experts // groups).topk(2, dim=-1).values.sum(dim=-1)
        picked = torch.topk(group_scores, top_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, picked, True)
        biased = biased.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    ids = torch.topk(biased, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                 valid_rows: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, ExpertRouting]:
    """(weights fp32 [T, top_k], expert ids int32 [T, top_k], ExpertRouting) from router logits [T, E]:
    softmax in fp32, the top_k experts per token (renormalized to sum to 1 with `renormalize`), the pairs
    grouped by expert as route_to_experts does (valid_rows: only the first valid_rows[0] tokens). With
    `correction_bias` [E] GLM-4.5's router instead: grouped_sigmoid_top_k with one group, times `scaling`. One
    Triton launch up to ROUTE_KERNEL_MAX_TOKENS tokens where Triton serves (no host sync: CUDA-graph capturable),
    torch ops otherwise."""
    tokens, num_experts = router_logits.shape
    if not (triton_serves(router_logits) and 0 < tokens <= ROUTE_KERNEL_MAX_TOKENS):
        if correction_bias is not None:
            weights, ids = grouped_sigmoid_top_k(router_logits, correction_bias, top_k, 1, 1, renormalize, scaling)
        else:
            weights, ids = top_k_experts(router_logits, top_k, renormalize)
        return weights, ids.to(torch.int32), route_to_experts(ids, num_experts, block_m, valid_rows)
    device = router_logits.device
    num_pairs = tokens * top_k
    slots = max_slots(num_pairs, num_experts, block_m)
    e_pad = max(16, next_pow2(num_experts))
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(slots, dtype=torch.int32, device=device)
    tile_expert = torch.empty(slots // block_m, dtype=torch.int32, device=device)
    group_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    next_slot = device_buffer("moe-route-next-slot", device, e_pad, torch.int32, zeroed=False)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    pdl = supports_pdl(device)
    # tiles no larger than the work (one compile per power of two of the token count): a one-token routing's token
    # tile is one row and its tile owners are found over next_pow2(tiles) tiles, not 64 (H200, 128 experts top 8,
    # one token: 4.7 -> 2.8 us with the packed argmax, bench/RESULTS.md thirtieth session)
    token_tile = min(4096 // e_pad, next_pow2(tokens))
    pair_block = max(16, min(64, next_pow2(num_pairs)))
    num_tiles = slots // block_m
    _route.moe_route_kernel[(1,)](
        logits, weights, ids, sorted_pairs, tile_expert, group_ends, next_slot,
        valid_rows if valid_rows is not None else group_ends, tokens, num_experts, logits.stride(0), slots,
        num_tiles, HAS_VALID=valid_rows is not None,
        TOP_K=top_k, K_PAD=next_pow2(top_k), NORM=renormalize, BM=block_m, E_PAD=e_pad,
        TB=token_tile, PB=pair_block, SB=64, PDL=pdl, launch_pdl=pdl,
        ONE_BLOCK=ROUTE_ONE_BLOCK and tokens <= token_tile and num_pairs <= pair_block,
        OB=min(64, next_pow2(num_tiles)),
        bias_ptr=correction_bias if correction_bias is not None else logits, scale=float(scaling),
        SIGMOID=correction_bias is not None,
        num_warps=1 if tokens <= ROUTE_ONE_WARP_MAX_TOKENS else 4)
    return weights, ids, ExpertRouting(sorted_pairs, tile_expert, num_pairs, top_k, block_m, group_ends)


def combine_experts(h: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype, *,
                    rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    ids: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] = sum over the choices of weights [T, top_k] * h [T * top_k, H] (rows in pair order), summed
    in fp32 in choice order: one Triton launch where Triton serves, torch elsewhere (the same math).
    `rows` (int [T * top_k], optional): pair p's output is h's row rows[p] (expert-sorted outputs read in
    place, no un-sorting copy). `bias` [E, H] with `ids` (int [T, top_k]): each pair's expert bias is added
    to its output in h's dtype first (a biased down projection). valid_rows: the rows from valid_rows[0] on
    are zeros (padding, not routed: their h rows were never written)."""
    tokens, top_k = weights.shape
    width = h.shape[1]
    if (bias is None) != (ids is None):
        raise ValueError("combine_experts: bias and ids go together")
    if not triton_serves(h) or tokens == 0:
        h = h[rows.long()] if rows is not None else h
        if bias is not None:
            h = h + bias.to(h.dtype)[ids.reshape(-1).long()]
        out = (h.view(tokens, top_k, width).float() * weights[..., None]).sum(dim=1)
        if valid_rows is not None:
            real = torch.arange(tokens, device=h.device) < valid_rows.reshape(-1)[:1]
            out = torch.where(real[:, None], out, 0.0)
        return out.to(out_dtype)
    out = torch.empty((tokens, width), dtype=out_dtype, device=h.device)
    block = min(1024, next_pow2(width))
    placeholder = weights  # any pointer for the operands a constexpr switches off
    pdl = supports_pdl(h.device)
    _combine.moe_combine_kernel[(tokens, -(-width // block))](
        h, weights.contiguous(), out, rows if rows is not None else placeholder,
        bias.contiguous() if bias is not None else placeholder, ids.contiguous() if ids is not None else placeholder,
        valid_rows if valid_rows is not None else placeholder, width, h.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK=block, HAS_ROWS=rows is not None, HAS_BIAS=bias is not None, HAS_VALID=valid_rows is not None,
        PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def pair_rows(sorted_pairs: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """int32 [num_pairs]: the slot of each pair in a routing of block_m 1 (sorted_pairs inverted), so that
    combine_experts reads expert-sorted outputs in place. No host sync."""
    slots = torch.arange(num_pairs, device=sorted_pairs.device, dtype=torch.int32)
    return torch.empty_like(slots).scatter_(0, sorted_pairs[:num_pairs].long(), slots)


def expert_of_rows(group_ends: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert whose group holds each row of an expert-sorted tensor (no host sync)."""
    slots = torch.arange(rows, device=group_ends.device, dtype=group_ends.dtype)
    return torch.searchsorted(group_ends, slots, right=True).clamp_(max=group_ends.numel() - 1)
