"""Merging the split-KV decode kernel's partials (attention_triton.paged_decode_attention): each split's
normalized output and log-sum-exp combine into one row per (sequence, head); for a W4A8 o_proj the merged
rows are quantized to fp8 in the same launch, by one program per (sequence, head) agreeing on the row's
scale through a spin barrier (merge_quant_barrier, while batch * heads fits on the GPU) or by one program
per sequence (merge_quant_rows). Every merge adds the splits in split order, so all give the same bits.
With `sinks` (gpt-oss) each head's sink logit joins the merged denominator after the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import _row_scale, _to_e4m3, pdl_handoff, shared_row_scale
from radiance.kernels.activation import fp8_outputs
from radiance.kernels.device_info import sm_count
from radiance.kernels.triton_support import row_barrier_buffers

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# the attention kernels' scores and log-sum-exps are base 2 (qk_scale carries log2(e)); a sink logit
# (natural units) is converted with it
LOG2E = tl.constexpr(1.4426950408889634)


def sinks_argument(sinks: torch.Tensor | None, heads: int, like: torch.Tensor) -> torch.Tensor:
    """A kernel's SINKS argument: the fp32 [heads] sinks, or `like` when HAS_SINKS is off (never read)."""
    if sinks is None:
        return like
    if sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks must be contiguous fp32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    return sinks


@triton.jit
def _add_split(out, total, lse_ptrs, acc_ptrs, s, m, mask_h, mask, stride_as):
    w = tl.exp2(tl.load(lse_ptrs + s, mask=mask_h, other=float("-inf")) - m)
    return out + tl.load(acc_ptrs + s * stride_as, mask=mask, other=0.0) * w[:, None], total + w


@triton.jit
def _merge_heads(ACC, LSE, SINKS, b, heads, num_heads, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                 SPLIT_GROUP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Sequence b's q heads `heads` [H] (those >= num_heads masked off: zeros) merged, [H, D_PAD] fp32:
    each head's splits weighted by their log-sum-exp. The splits are added one after another in
    split order (not by tl.sum, whose order follows the layout, i.e. the tile and num_warps), so
    every merge kernel computes the same bits whatever its tile and SPLIT_GROUP: the splits are
    unrolled SPLIT_GROUP at a time (their loads in flight together) in a loop over the groups, so
    that registers hold ~SPLIT_GROUP tiles of partials however many splits there are. With HAS_SINKS
    each head's sink SINKS[head] then joins the denominator (a logit without a value)."""
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_h = heads < num_heads
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse_ptrs = LSE + b * stride_lb + heads * stride_lh
    acc_ptrs = ACC + b * stride_ab + heads[:, None] * stride_ah + offs_d[None, :]
    lse = tl.load(lse_ptrs[:, None] + offs_s[None, :], mask=mask_h[:, None] & (offs_s < SPLITS)[None, :],
                  other=float("-inf"))
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (context 0): zeros, not NaN
    total = tl.zeros_like(m)
    out = tl.zeros([heads.shape[0], D_PAD], tl.float32)
    FULL: tl.constexpr = SPLITS - SPLITS % SPLIT_GROUP
    for s0 in range(0, FULL, SPLIT_GROUP):
        for j in tl.static_range(SPLIT_GROUP):
            out, total = _add_split(out, total, lse_ptrs, acc_ptrs, s0 + j, m, mask_h, mask, stride_as)
    for s in tl.static_range(FULL, SPLITS):
        out, total = _add_split(out, total, lse_ptrs, acc_ptrs, s, m, mask_h, mask, stride_as)
    if HAS_SINKS:
        total += tl.exp2(tl.load(SINKS + heads, mask=mask_h, other=0.0) * LOG2E - m)
    return out / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _merge_head(ACC, LSE, SINKS, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                HAS_SINKS: tl.constexpr):
    """One (sequence, q head)'s output [D_PAD] in fp32 (_merge_heads of that one head, all splits
    unrolled)."""
    one = h + tl.arange(0, 1)
    out = _merge_heads(ACC, LSE, SINKS, b, one, h + 1, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                       HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLITS, HAS_SINKS)
    return tl.reshape(out, [D_PAD])


@triton.jit
def _decode_merge_kernel(ACC, LSE, O, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob,
                         stride_oh, SINKS, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                         S_PAD: tl.constexpr, PDL: tl.constexpr = False, HAS_SINKS: tl.constexpr = False):
    pdl_handoff(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    out = _merge_head(ACC, LSE, SINKS, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                      HEAD_DIM, D_PAD, SPLITS, S_PAD, HAS_SINKS)
    offs_d = tl.arange(0, D_PAD)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _decode_merge_quant_kernel(ACC, LSE, XQ, XS, SLOTS, COUNT, stride_ab, stride_ah, stride_as, stride_lb,
                               stride_lh, SINKS, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                               S_PAD: tl.constexpr, H_PAD: tl.constexpr, OUT_DTYPE: tl.constexpr,
                               PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """_decode_merge_kernel and the per-token fp8 quantization of its output row (all heads) in one
    launch, for the W4A8 o_proj: the heads of a sequence agree on the row's amax through a spin
    barrier (every program resident: the launcher keeps batch * heads within the SM count). The
    merged values are rounded to the model's dtype first, so the bytes equal merge-then-quantize."""
    pdl_handoff(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.num_programs(0)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    y = _merge_head(ACC, LSE, SINKS, b, h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                    HEAD_DIM, D_PAD, SPLITS, S_PAD, HAS_SINKS).to(OUT_DTYPE).to(tl.float32)
    local = tl.max(tl.where(mask_d, tl.abs(y), 0.0), axis=0)
    has_nan = tl.sum((y != y).to(tl.int32), axis=0) > 0
    scale = shared_row_scale(SLOTS, COUNT, b, h, local, has_nan, heads, H_PAD)
    tl.store(XQ + b * heads * HEAD_DIM + h * HEAD_DIM + offs_d, _to_e4m3(y, scale, False), mask=mask_d)
    if h == 0:
        tl.store(XS + b, scale)


@triton.jit
def _rounded_heads(ACC, LSE, SINKS, b, heads, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                   HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                   S_PAD: tl.constexpr, SPLIT_GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """(_merge_heads rounded to the model's dtype, as fp32 [H, D_PAD]; the mask of its real elements)."""
    y = _merge_heads(ACC, LSE, SINKS, b, heads, HEADS, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                     HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, HAS_SINKS).to(OUT_DTYPE).to(tl.float32)
    return y, (heads < HEADS)[:, None] & (tl.arange(0, D_PAD) < HEAD_DIM)[None, :]


@triton.jit
def _decode_merge_rows_quant_kernel(ACC, LSE, XQ, XS, stride_ab, stride_ah, stride_as, stride_lb,
                                    stride_lh, SINKS, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                                    SPLITS: tl.constexpr, S_PAD: tl.constexpr, SPLIT_GROUP: tl.constexpr,
                                    H_BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
                                    PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """_decode_merge_kernel then quantize_rows_kernel (per-token e4m3 of the row of all heads) in one
    launch, one program per sequence: no barrier, so any batch (and the interpreter). The merged
    values are rounded to the model's dtype first, so the bytes equal merge-then-quantize. A row of
    up to H_BLOCK heads stays in registers; a longer one takes two passes over H_BLOCK-head chunks
    (the amax, then the merge again, its partials from the cache, and the division)."""
    pdl_handoff(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, H_BLOCK)
    xq_row = XQ + b * (HEADS * HEAD_DIM) + tl.arange(0, D_PAD)[None, :]
    if H_BLOCK >= HEADS:
        y, mask = _rounded_heads(ACC, LSE, SINKS, b, offs_h, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                                 HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE, HAS_SINKS)
        amax = tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), axis=0)
        nans = tl.sum(tl.sum(((y != y) & mask).to(tl.int32), axis=1), axis=0)
        scale = _row_scale(amax, nans > 0)
        tl.store(xq_row + offs_h[:, None] * HEAD_DIM, _to_e4m3(y, scale, INTERPRETER), mask=mask)
        tl.store(XS + b, scale)
    else:
        amax = tl.zeros([H_BLOCK, D_PAD], tl.float32)
        nans = tl.zeros([H_BLOCK, D_PAD], tl.int32)
        for h0 in range(0, HEADS, H_BLOCK):
            y, mask = _rounded_heads(ACC, LSE, SINKS, b, h0 + offs_h, stride_ab, stride_ah, stride_as, stride_lb,
                                     stride_lh, HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE,
                                     HAS_SINKS)
            amax = tl.maximum(amax, tl.where(mask, tl.abs(y), 0.0))
            nans += ((y != y) & mask).to(tl.int32)
        scale = _row_scale(tl.max(tl.max(amax, axis=1), axis=0), tl.sum(tl.sum(nans, axis=1), axis=0) > 0)
        for h0 in range(0, HEADS, H_BLOCK):
            y, mask = _rounded_heads(ACC, LSE, SINKS, b, h0 + offs_h, stride_ab, stride_ah, stride_as, stride_lb,
                                     stride_lh, HEADS, HEAD_DIM, D_PAD, SPLITS, S_PAD, SPLIT_GROUP, OUT_DTYPE,
                                     HAS_SINKS)
            tl.store(xq_row + (h0 + offs_h)[:, None] * HEAD_DIM, _to_e4m3(y, scale, INTERPRETER), mask=mask)
        tl.store(XS + b, scale)


def merge_quant_serves(q: torch.Tensor) -> bool:
    """Whether the barrier merge + quantize (_decode_merge_quant_kernel) runs: it needs every program
    of a row resident at once (CUDA only: the interpreter runs programs one by one, so its barrier
    would never open). Otherwise _decode_merge_rows_quant_kernel does (see ROWS_MAX_SPLITS)."""
    return q.is_cuda and q.shape[0] * q.shape[1] <= sm_count(q.device)


# the per-row merge + quantize serves up to this many splits: one program merges heads x splits
# partials, so a few sequences with many splits (batch 3 of a 64-head model: 11) would leave most SMs
# idle; there the merge (a program per head) and quantize_activations run as two launches
ROWS_MAX_SPLITS = 4

# merged values one program of _decode_merge_rows_quant_kernel holds at once (fp32, 16 a thread at 16
# warps): rows up to this wide (64 heads x 128) in one pass, wider ones in two over chunks of heads
ROW_TILE = 8192


def _s_pad(splits: int) -> int:
    return max(2, triton.next_power_of_2(splits))


def merge_splits(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The split partials acc [B, Hq, S, D] / lse [B, Hq, S] merged: [B, Hq, D] in `dtype`; with `sinks`
    (fp32 [Hq]) each head's sink logit in the denominator."""
    batch, heads, splits, dim = acc.shape
    out = torch.empty((batch, heads, dim), dtype=dtype, device=acc.device)
    _decode_merge_kernel[(batch, heads)](
        acc, lse, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), sinks_argument(sinks, heads, lse), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim),
        SPLITS=splits, S_PAD=_s_pad(splits), PDL=pdl, launch_pdl=pdl, HAS_SINKS=sinks is not None, num_warps=1)
    return out


def merge_quant_barrier(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(merge_splits(acc, lse, dtype, sinks=sinks)) in one launch of batch * heads
    programs (CUDA, all resident: merge_quant_serves)."""
    batch, heads, splits, dim = acc.shape
    x_q, x_scale = fp8_outputs(batch, heads * dim, acc.device)
    slots, count = row_barrier_buffers(acc.device, batch, heads)
    _decode_merge_quant_kernel[(heads, batch)](
        acc, lse, x_q, x_scale, slots, count, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
        lse.stride(1), sinks_argument(sinks, heads, lse), HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim),
        SPLITS=splits, S_PAD=_s_pad(splits), H_PAD=max(2, triton.next_power_of_2(heads)),
        OUT_DTYPE=_TL_DTYPES[dtype], PDL=pdl, launch_pdl=pdl, HAS_SINKS=sinks is not None, num_warps=1)
    return x_q, x_scale


def merge_quant_rows(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False,
                     tile: int = ROW_TILE, split_group: int | None = None,
                     sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(merge_splits(acc, lse, dtype, sinks=sinks)) in one launch of one program per
    sequence (`tile`, `split_group`: see ROW_TILE and _merge_heads; the tests vary them)."""
    batch, heads, splits, dim = acc.shape
    d_pad = triton.next_power_of_2(dim)
    h_block = min(triton.next_power_of_2(heads), max(1, tile // d_pad))
    warps = max(1, min(16, h_block * d_pad // 512))
    # splits unrolled at a time: ~64 registers a thread of partials in flight (all of them unrolled,
    # the compiler hoists every load: 64 heads x 11 splits spilled at 16 warps)
    per_thread = max(1, h_block * d_pad // (32 * warps))
    x_q, x_scale = fp8_outputs(batch, heads * dim, acc.device)
    _decode_merge_rows_quant_kernel[(batch,)](
        acc, lse, x_q, x_scale, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        sinks_argument(sinks, heads, lse), HEADS=heads, HEAD_DIM=dim, D_PAD=d_pad, SPLITS=splits, S_PAD=_s_pad(splits),
        SPLIT_GROUP=split_group or max(1, min(splits, 64 // per_thread)), H_BLOCK=h_block, OUT_DTYPE=_TL_DTYPES[dtype],
        INTERPRETER=not acc.is_cuda, PDL=pdl, launch_pdl=pdl, HAS_SINKS=sinks is not None, num_warps=warps)
    return x_q, x_scale
