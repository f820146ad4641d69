"""The last step of a mixture-of-experts layer: each token's expert outputs, weighted by its router, summed."""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff


@triton.jit
def moe_combine_kernel(h_ptr, w_ptr, out_ptr, rows_ptr, bias_ptr, ids_ptr, valid_ptr, H, stride_h, stride_o,
                       TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr = False,
                       HAS_BIAS: tl.constexpr = False, HAS_VALID: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t, :] = sum_j w[t, j] * h_p[:] over the pairs p = t * TOP_K + j, in fp32 and in choice order (one
    launch where torch took three: the upcast, the product and the sum). h_p is h's row p, or with HAS_ROWS
    its row rows[p] (expert-sorted rows read in place); with HAS_BIAS, bias[ids[p]] is added to it first,
    rounded to h's dtype as torch's add would be. With HAS_VALID the rows from valid_ptr[0] on (padding, whose
    pairs were not routed) are zeros. PDL: launched as a programmatic dependent (act_quant.pdl_handoff).
    Grid [T, cdiv(H, BLOCK)]."""
    pdl_handoff(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        row = tl.load(rows_ptr + pair).to(tl.int64) if HAS_ROWS else pair
        w = tl.load(w_ptr + pair)
        v = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            b = tl.load(bias_ptr + expert * H + offs, mask=mask, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) + b).to(h_ptr.dtype.element_ty)
        acc += w * v.to(tl.float32)
    if HAS_VALID:  # selected, not multiplied: a padding row's unwritten h rows may hold NaN
        acc = tl.where(token < tl.load(valid_ptr).to(tl.int64), acc, 0.0)
    tl.store(out_ptr + token * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
