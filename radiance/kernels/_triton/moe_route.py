"""Routing of a mixture-of-experts layer in one launch, for decode-sized token counts.

One program does what ~30 small torch launches did (softmax, top-k, renormalization, the count, sort and
padding of moe_routing.route_to_experts): at a decode step those launches cost more than both expert GEMMs.
  1. per token: softmax of the router logits in fp32, the top_k by repeated argmax (ties: the lower
     expert), optionally renormalized; weights and expert ids stored per pair p = token * TOP_K + choice;
  2. per expert: its pair count, its group's first slot (groups padded to BM slots, in expert order),
     and the expert of every BM-slot tile (-1 past the used ones); every slot first holds the padding;
  3. the pairs, block by block in pair order, into their expert's next free slots (a stable layout:
     within a group the pairs keep their order). Global scratch `next_slot` [E_PAD] carries each
     group's next free slot between blocks; CTA barriers order the phases (one program: a barrier makes
     its global writes visible to all its threads).
With ONE_BLOCK (all tokens in one TB tile and all pairs in one PB block: decode steps, up to 8 tokens of top 8)
the weights and ids stay in registers from phase 1 to 3 and each pair's slot comes from its group's first slot
in registers: no global round trip through ids, weights or next_slot between the phases, and one barrier.
With SIGMOID (GLM-4.5's router, moe_routing.grouped_sigmoid_top_k with one expert group) phase 1 takes the top_k
by sigmoid(logit) + bias[expert] (a signed key) and weighs each pick by its unbiased sigmoid score; every weight
is then multiplied by `scale` (1.0, exact, for the softmax routers).
With PDL the kernel is launched as a programmatic dependent (act_quant.pdl_handoff).
With HAS_VALID only the first valid_ptr[0] tokens are routed (a CUDA graph's padding rows follow them): their
pairs fill the groups, and every later pair p is parked in slot (used tiles) * BM + p - (routed pairs), past
the used tiles, so that the slots still hold each pair once.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff


@triton.jit
def _softmax_rows(logits_ptr, toks, T, experts, E, stride_l):
    """fp32 softmax [TB, E_PAD] of the router logits of tokens `toks` (dead rows and padding experts: 0)."""
    t_live = toks < T
    e_live = experts < E
    logits = tl.load(logits_ptr + toks[:, None].to(tl.int64) * stride_l + experts[None, :],
                     mask=t_live[:, None] & e_live[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(t_live[:, None], logits, tl.where(e_live[None, :], 0.0, float("-inf")))  # no NaN rows
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    return probs / tl.sum(probs, axis=1)[:, None]


@triton.jit
def _sigmoid_rows(logits_ptr, bias_ptr, toks, T, experts, E, stride_l):
    """(sigmoid scores [TB, E_PAD] of the router logits of tokens `toks`, the keys the experts are picked by: score +
    bias[expert]; dead rows score 0, padding experts key -inf)."""
    t_live = toks < T
    e_live = experts < E
    logits = tl.load(logits_ptr + toks[:, None].to(tl.int64) * stride_l + experts[None, :],
                     mask=t_live[:, None] & e_live[None, :], other=0.0).to(tl.float32)
    scores = tl.where(t_live[:, None] & e_live[None, :], 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    bias = tl.load(bias_ptr + experts, mask=e_live, other=0.0).to(tl.float32)
    keys = tl.where(e_live[None, :], scores + bias[None, :], float("-inf"))
    return scores, keys


@triton.jit
def _take_top_signed(scores, keys, experts, toks, routed, E_PAD: tl.constexpr):
    """_take_top over keys of either sign (score + bias): (the pick's unbiased score, its expert (ties: the lower
    one), the picks per expert among the routed tokens, keys with the picks set to -inf). A float's bits order
    like an int32 once a negative one's 31 low bits are flipped."""
    bits = keys.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.max((ordered << 32) | (E_PAD - 1 - experts[None, :]).to(tl.int64), axis=1)
    pick = (E_PAD - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    picked = experts[None, :] == pick[:, None]
    top = tl.sum(tl.where(picked, scores, 0.0), axis=1)
    counts = tl.sum((picked & (toks < routed)[:, None]).to(tl.int32), axis=0)
    return top, pick, counts, tl.where(picked, float("-inf"), keys)


@triton.jit
def _take_top(probs, experts, toks, routed, E_PAD: tl.constexpr):
    """One top-k step over probs [TB, E_PAD]: (each row's largest probability, its expert (ties: the lower one),
    the picks per expert among the routed tokens [E_PAD], probs with the picks set to -1).
    Max and argmax are one int64 max: the probability's bits above, E_PAD - 1 - expert below (non-negative floats
    order like their bits; a picked -1.0 is a negative int32 and stays below): one reduction where tl.max and
    tl.argmax were two."""
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.max((bits << 32) | (E_PAD - 1 - experts[None, :]).to(tl.int64), axis=1)
    top = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    pick = (E_PAD - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    picked = experts[None, :] == pick[:, None]
    counts = tl.sum((picked & (toks < routed)[:, None]).to(tl.int32), axis=0)
    return top, pick, counts, tl.where(picked, -1.0, probs)


@triton.jit
def _lay_out_groups(counts, experts, E, pairs_ptr, tile_expert_ptr, group_end_ptr, num_pairs, num_slots, num_tiles,
                    BM: tl.constexpr, SB: tl.constexpr, OB: tl.constexpr):
    """Phase 2 from the per-expert pair counts: group ends stored, every slot set to the padding pair, each tile's
    expert stored (-1 past the used ones). Returns (each group's first slot [E_PAD], the first slot past the
    used tiles)."""
    e_live = experts < E
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)  # one past each expert's last tile
    tl.store(group_end_ptr + experts, tile_end * BM, mask=e_live)
    for s0 in range(0, num_slots, SB):
        slots = s0 + tl.arange(0, SB)
        tl.store(pairs_ptr + slots, tl.zeros([SB], dtype=tl.int32) + num_pairs, mask=slots < num_slots)
    for i0 in range(0, num_tiles, OB):  # [OB, E_PAD] comparisons: OB no larger than the tiles (a decode has few)
        tile = i0 + tl.arange(0, OB)
        # a tile belongs to the first expert whose tiles end after it (an empty expert ends where it starts)
        owner = tl.sum(((tile_end[None, :] <= tile[:, None]) & e_live[None, :]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + tile, tl.where(owner < E, owner, -1), mask=tile < num_tiles)
    return (tile_end - tiles) * BM, tl.sum(tiles, axis=0) * BM


@triton.jit
def _route_one_block(logits_ptr, bias_ptr, weights_ptr, ids_ptr, pairs_ptr, tile_expert_ptr, group_end_ptr, T, E,
                     stride_l, num_slots, num_tiles, routed, scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     NORM: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr, TB: tl.constexpr, SB: tl.constexpr,
                     HAS_VALID: tl.constexpr, OB: tl.constexpr, SIGMOID: tl.constexpr):
    """moe_route_kernel for T <= TB tokens whose T * TOP_K pairs form one block: the phases hand each other
    registers (the pairs are the [TB, K_PAD] choice matrix read row by row)."""
    experts = tl.arange(0, E_PAD)
    toks = tl.arange(0, TB)
    choices = tl.arange(0, K_PAD)
    if SIGMOID:
        scores, probs = _sigmoid_rows(logits_ptr, bias_ptr, toks, T, experts, E, stride_l)
    else:
        probs = _softmax_rows(logits_ptr, toks, T, experts, E, stride_l)
    top_w = tl.zeros([TB, K_PAD], dtype=tl.float32)
    top_id = tl.zeros([TB, K_PAD], dtype=tl.int32)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        if SIGMOID:
            top, pick, picks, probs = _take_top_signed(scores, probs, experts, toks, routed, E_PAD)
        else:
            top, pick, picks, probs = _take_top(probs, experts, toks, routed, E_PAD)
        counts += picks
        top_w = tl.where(choices[None, :] == j, top[:, None], top_w)
        top_id = tl.where(choices[None, :] == j, pick[:, None], top_id)
    if NORM:  # the top_k weights of a token sum to 1 (K_PAD's extra columns hold 0)
        top_w = tl.div_rn(top_w, tl.maximum(tl.sum(top_w, axis=1), 1e-30)[:, None])  # IEEE: x / x is 1
    if SIGMOID:
        top_w = top_w * scale
    pair = toks[:, None] * TOP_K + choices[None, :]
    chosen = (toks < T)[:, None] & (choices < TOP_K)[None, :]
    tl.store(weights_ptr + pair, top_w, mask=chosen)
    tl.store(ids_ptr + pair, top_id, mask=chosen)

    first_slot, parked = _lay_out_groups(counts, experts, E, pairs_ptr, tile_expert_ptr, group_end_ptr, T * TOP_K,
                                         num_slots, num_tiles, BM, SB, OB)
    P: tl.constexpr = TB * K_PAD
    pair = tl.reshape(pair, (P,))
    expert = tl.reshape(top_id, (P,))
    routed_pairs = routed * TOP_K
    p_live = tl.reshape(chosen, (P,)) & (pair < routed_pairs)
    # the pair's rank among the same expert's pairs before it (pair order), then its slot
    earlier = (expert[:, None] == expert[None, :]) & (pair[None, :] < pair[:, None]) & p_live[None, :]
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(tl.where(expert[:, None] == experts[None, :], first_slot[None, :], 0), axis=1)
    tl.debug_barrier()  # the padding is in every slot before the pairs overwrite theirs
    tl.store(pairs_ptr + start + rank, pair, mask=p_live)
    if HAS_VALID:  # a padding row's pairs: parked past the used tiles, in pair order
        tl.store(pairs_ptr + parked + pair - routed_pairs, pair,
                 mask=tl.reshape(chosen, (P,)) & (pair >= routed_pairs))


@triton.jit
def moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, pairs_ptr, tile_expert_ptr, group_end_ptr, next_slot_ptr,
                     valid_ptr, T, E, stride_l, num_slots, num_tiles,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, BM: tl.constexpr,
                     E_PAD: tl.constexpr, TB: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
                     HAS_VALID: tl.constexpr = False, PDL: tl.constexpr = False, ONE_BLOCK: tl.constexpr = False,
                     OB: tl.constexpr = 64,  # OB: tiles whose owners one step of phase 2 finds
                     bias_ptr=None, scale=1.0, SIGMOID: tl.constexpr = False):
    pdl_handoff(PDL)
    routed = tl.minimum(tl.load(valid_ptr).to(tl.int32), T) if HAS_VALID else T  # tokens that get experts
    if ONE_BLOCK:
        _route_one_block(logits_ptr, bias_ptr, weights_ptr, ids_ptr, pairs_ptr, tile_expert_ptr, group_end_ptr, T, E,
                         stride_l, num_slots, num_tiles, routed, scale, TOP_K, K_PAD, NORM, BM, E_PAD, TB, SB,
                         HAS_VALID, OB, SIGMOID)
    else:
        _route_blocks(logits_ptr, bias_ptr, weights_ptr, ids_ptr, pairs_ptr, tile_expert_ptr, group_end_ptr,
                      next_slot_ptr, T, E, stride_l, num_slots, num_tiles, routed, scale, TOP_K, K_PAD, NORM, BM,
                      E_PAD, TB, PB, SB, HAS_VALID, OB, SIGMOID)


@triton.jit
def _route_blocks(logits_ptr, bias_ptr, weights_ptr, ids_ptr, pairs_ptr, tile_expert_ptr, group_end_ptr,
                  next_slot_ptr, T, E, stride_l, num_slots, num_tiles, routed, scale, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, NORM: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr, TB: tl.constexpr,
                  PB: tl.constexpr, SB: tl.constexpr, HAS_VALID: tl.constexpr, OB: tl.constexpr,
                  SIGMOID: tl.constexpr):
    """moe_route_kernel for any token count: token tiles of TB, pair blocks of PB, each group's next free slot
    carried between blocks in next_slot (global scratch)."""
    experts = tl.arange(0, E_PAD)
    num_pairs = T * TOP_K
    routed_pairs = routed * TOP_K
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for t0 in range(0, T, TB):
        toks = t0 + tl.arange(0, TB)
        t_live = toks < T
        if SIGMOID:
            scores, probs = _sigmoid_rows(logits_ptr, bias_ptr, toks, T, experts, E, stride_l)
        else:
            probs = _softmax_rows(logits_ptr, toks, T, experts, E, stride_l)
        for j in tl.static_range(TOP_K):
            if SIGMOID:
                top, top_id, picks, probs = _take_top_signed(scores, probs, experts, toks, routed, E_PAD)
                if not NORM:
                    top = top * scale
            else:
                top, top_id, picks, probs = _take_top(probs, experts, toks, routed, E_PAD)
            tl.store(weights_ptr + toks * TOP_K + j, top, mask=t_live)
            tl.store(ids_ptr + toks * TOP_K + j, top_id, mask=t_live)
            counts += picks
    tl.debug_barrier()
    if NORM:  # the top_k weights of a token sum to 1
        choices = tl.arange(0, K_PAD)
        for t0 in range(0, T, TB):
            toks = t0 + tl.arange(0, TB)
            live = (toks < T)[:, None] & (choices < TOP_K)[None, :]
            ptrs = weights_ptr + toks[:, None] * TOP_K + choices[None, :]
            w = tl.load(ptrs, mask=live, other=0.0)
            w = tl.div_rn(w, tl.maximum(tl.sum(w, axis=1), 1e-30)[:, None])  # dead rows: 0, not NaN; x / x is 1
            if SIGMOID:
                w = w * scale
            tl.store(ptrs, w, mask=live)

    first_slot, parked = _lay_out_groups(counts, experts, E, pairs_ptr, tile_expert_ptr, group_end_ptr, num_pairs,
                                         num_slots, num_tiles, BM, SB, OB)
    tl.store(next_slot_ptr + experts, first_slot)
    tl.debug_barrier()

    lanes = tl.arange(0, PB)
    for p0 in range(0, num_pairs, PB):
        pair = p0 + lanes
        p_live = pair < routed_pairs
        expert = tl.load(ids_ptr + pair, mask=p_live, other=0)
        earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None]) & p_live[None, :]
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # same-expert pairs before it in this block
        slot = tl.load(next_slot_ptr + expert, mask=p_live, other=0) + rank
        tl.store(pairs_ptr + slot, pair, mask=p_live)
        if HAS_VALID:  # a padding row's pairs: parked past the used tiles, in pair order
            tl.store(pairs_ptr + parked + pair - routed_pairs, pair, mask=(pair >= routed_pairs) & (pair < num_pairs))
        added = tl.sum(((expert[:, None] == experts[None, :]) & p_live[:, None]).to(tl.int32), axis=0)
        moved = tl.load(next_slot_ptr + experts) + added
        tl.debug_barrier()  # every lane has read next_slot before it moves on
        tl.store(next_slot_ptr + experts, moved)
        tl.debug_barrier()
