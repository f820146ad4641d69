"""Row argmax of logits in two launches: per-chunk (max, first index), then the first chunk holding
the row's max. torch's argmax reduces a 128k-vocabulary row in one CTA (27 us on the H200); spread
over 32 programs per row it takes a few. Ties go to the lowest index and a NaN wins over every
number (the first NaN's index), as torch.argmax does."""

import triton
import triton.language as tl

NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _first_max(vals, idx):
    """(max, lowest index holding it) of vals, where any NaN is the max."""
    is_nan = vals != vals
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), vals), axis=0)
    pick = tl.where(any_nan, is_nan, vals == top)
    return tl.where(any_nan, float("nan"), top), tl.min(tl.where(pick, idx, NO_INDEX), axis=0)


@triton.jit
def argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    top, first = _first_max(x, offs)
    chunks = tl.num_programs(0)
    tl.store(val_ptr + row * chunks + chunk, top)
    tl.store(idx_ptr + row * chunks + chunk, first)


@triton.jit
def argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, chunks, C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    live = offs < chunks
    vals = tl.load(val_ptr + row * chunks + offs, mask=live, other=float("-inf"))
    idx = tl.load(idx_ptr + row * chunks + offs, mask=live, other=NO_INDEX)
    # chunks are in index order: the lowest index among the chunks holding the max is the row's first
    tl.store(out_ptr + row, _first_max(vals, idx)[1].to(tl.int64))
