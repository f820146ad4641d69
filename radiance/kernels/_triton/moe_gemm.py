"""The grouped (mixture-of-experts) W4A8 GEMM: every (token, expert choice) pair times its expert's weight.

The structure of gemm.w4a8_gemm_kernel without split-K (an expert's share of the tokens is small, and
many experts fill the grid on their own). The routing (moe_routing.route_to_experts) lays the pairs out in
slots grouped by expert, each group padded to a multiple of BM, so a BM-slot tile holds one expert's
pairs: work item w -> (slot tile t, column tile pid_n), with the column tiles of one slot tile next to one
another (they read the same activation rows). One program per work item (a tile past the used ones,
tile_expert -1, ends at once), or PERSISTENT: a fixed grid walks the used ones (w4a8_moe_gemm_kernel).

Both tilings of the dense kernel: SWAP_AB (the weight rows fill the MMA's 64-wide M, the slots its N; the
expanded weights feed the MMA from registers) for 16- and 128-slot tiles, plain (slots as M, BM % 64 == 0;
the weights through shared memory) for the persistent 64-slot one (moe.MOE_CONFIGS).

The activation row of pair p is p // rows_div: rows_div = top_k when x holds one row per token (the
gate_up input), 1 when it holds one row per pair (the down input). Results are stored at row p of the
output, through gemm._epilogue: plus the expert's bias with HAS_BIAS, plain, or with GLU act(gate, up) (ACT:
silu or gpt-oss's swiglu_oai) and each row's amax parts.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff
from radiance.kernels._triton.convert import expand_e2m1_words, live_words
from radiance.kernels._triton.gemm import _epilogue, _tile_columns, _unpack_shifts, live_k


@triton.jit
def _tile_pairs(pairs_ptr, t, num_pairs, rows_div, BM: tl.constexpr):
    """(pair index, activation row, live) of the BM slots of tile t; padding slots (pair == num_pairs)
    point at pair and row 0 so that every address stays inside its tensor."""
    pair = tl.load(pairs_ptr + t * BM + tl.arange(0, BM))
    live = pair < num_pairs
    pair = tl.where(live, pair, 0)
    return pair, pair // rows_div, live


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, kt, N, groups, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """The e4m3 weight tile [BN, BK] of K tile kt, block shifts folded in (see gemm.py)."""
    G: tl.constexpr = BK // 128
    NB: tl.constexpr = BK // 32
    if EVEN_K:
        words = tl.load(w_ptrs + kt * (BK // 8))
        s = tl.load(s_ptrs + kt * G * N)
    else:
        words = tl.load(w_ptrs + kt * (BK // 8), mask=live_words(kt, groups, BK)[None, :], other=0)
        group_live = (kt * G + tl.arange(0, G)) < groups
        s = tl.load(s_ptrs + kt * G * N, mask=group_live[None, :], other=0)
    words = tl.reshape(tl.permute(tl.reshape(words, (BN, G, 4, 4)), (0, 1, 3, 2)), (BN, NB, 4))  # [BN, block, q]
    return expand_e2m1_words(words, _unpack_shifts(s), USE_ASM)


@triton.jit
def _moe_tile(t, expert, pid_n, num_pid_n, x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr, amax_ptr, pairs_ptr,
              num_pairs, rows_div, N, K, stride_xm, stride_om,
              SWAP_AB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              USE_ASM: tl.constexpr, PRECISE_ACC: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
              ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """Slot tile t (all of its pairs `expert`'s) times column tile pid_n of that expert's weight, stored
    through gemm._epilogue."""
    pair, x_row, live = _tile_pairs(pairs_ptr, t, num_pairs, rows_div, BM)
    cols, offs_n, out_n = _tile_columns(pid_n, N, BN, GLU)
    offs_k = tl.arange(0, BK)
    G: tl.constexpr = BK // 128
    groups = tl.cdiv(K, 128)
    words_per_row = groups * 16
    e = expert.to(tl.int64)
    # padding slots point at row 0 but load nothing (at decode 15 of a tile's 16 slots are padding: their loads
    # would multiply the activation traffic); their results are never stored
    x_ptrs = x_ptr + x_row.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = (w_ptr + (e * N + offs_n)[:, None] * words_per_row  # [BN, BK/8]: 4 threads per row (gemm.py)
              + tl.arange(0, BK // 8)[None, :])
    s_ptrs = shift_ptr + e * groups * N + tl.arange(0, G)[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, G]

    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            x = tl.load(x_ptrs + kt * BK, mask=live[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + kt * BK, mask=live[:, None] & live_k(kt, K, BK)[None, :], other=0.0)
        w = _weight_tile(w_ptrs, s_ptrs, kt, N, groups, BN, BK, EVEN_K, USE_ASM)
        if PRECISE_ACC:  # the MMA sums one K tile from zero; the fp32 add promotes it
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
        elif SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)

    xs = tl.load(xs_ptr + x_row)
    ws = tl.load(ws_ptr + e * N + offs_n)
    acc = acc * xs[:, None] * ws[None, :]  # the dense kernel's order: the same bytes per row
    _epilogue(out_ptr, amax_ptr, bias_ptr + e * N, acc, pair, live, cols, offs_n, out_n, stride_om, num_pid_n,
              pid_n, HAS_BIAS, GLU, BM, BN, ACT, ALPHA, LIMIT)


@triton.jit(do_not_specialize=["num_pairs", "rows_div", "num_programs"])  # one compile for every token count
def w4a8_moe_gemm_kernel(x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr, amax_ptr, pairs_ptr,
                         tile_expert_ptr, group_ends_ptr, num_experts, num_pairs, rows_div, N, K, stride_xm,
                         stride_om, num_programs,
                         SWAP_AB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, PRECISE_ACC: tl.constexpr,
                         HAS_BIAS: tl.constexpr = False, GLU: tl.constexpr = False, ACT: tl.constexpr = 0,
                         ALPHA: tl.constexpr = None, LIMIT: tl.constexpr = None, PERSISTENT: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """w: int32 kernel words [E, N, K'/8], shift: int32 [E, K'/128, N] (4 int8 block shifts each),
    ws: fp32 [E, N], bias [E, N] (HAS_BIAS); x e4m3 [R, K] with scales xs [R]; out [num_pairs, N] (GLU:
    [num_pairs, N/2] and amax int32 [num_pairs, column tiles]). ACT, ALPHA, LIMIT: gemm._epilogue's.
    PERSISTENT: num_programs programs walk the (slot tile, column tile) pairs of the used slots (the last
    expert's group end) with a stride of num_programs, in one flattened loop, so that the software pipeline
    may run on across tile boundaries (measured: a few percent on short-K tiles; moe.MOE_CONFIGS). Otherwise
    one program per pair, those past the used tiles (tile_expert -1) ending at once. PDL: launched as a
    programmatic dependent (act_quant.pdl_handoff): every operand but the weights comes from the kernels just
    before (routing, activations), and the weights' rows depend on the routing, so nothing is prefetched."""
    pdl_handoff(PDL)
    num_pid_n = tl.cdiv(N // 2, BN // 2) if GLU else tl.cdiv(N, BN)
    if PERSISTENT:
        work = tl.load(group_ends_ptr + num_experts - 1) // BM * num_pid_n
        for w in tl.range(tl.program_id(0), work, num_programs, flatten=True):
            t = w // num_pid_n
            _moe_tile(t, tl.load(tile_expert_ptr + t), w % num_pid_n, num_pid_n, x_ptr, xs_ptr, w_ptr, shift_ptr,
                      ws_ptr, bias_ptr, out_ptr, amax_ptr, pairs_ptr, num_pairs, rows_div, N, K, stride_xm, stride_om,
                      SWAP_AB, BM, BN, BK, EVEN_K, USE_ASM, PRECISE_ACC, HAS_BIAS, GLU, ACT, ALPHA, LIMIT)
    else:
        pid = tl.program_id(0)
        t = pid // num_pid_n
        expert = tl.load(tile_expert_ptr + t)
        if expert >= 0:
            _moe_tile(t, expert, pid % num_pid_n, num_pid_n, x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr,
                      out_ptr, amax_ptr, pairs_ptr, num_pairs, rows_div, N, K, stride_xm, stride_om,
                      SWAP_AB, BM, BN, BK, EVEN_K, USE_ASM, PRECISE_ACC, HAS_BIAS, GLU, ACT, ALPHA, LIMIT)
