"""The last step of a mixture-of-experts layer: each token's expert outputs, weighted by its router, summed."""

import triton
import triton.language as tl


@triton.jit
def moe_combine_kernel(h_ptr, w_ptr, out_ptr, H, stride_h, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, :] = sum_j w[t, j] * h[t * TOP_K + j, :], in fp32 and in choice order (one launch where torch
    took three: the upcast, the product and the sum). Grid [T, cdiv(H, BLOCK)]."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + token * TOP_K + j)
        acc += w * tl.load(h_ptr + (token * TOP_K + j) * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
