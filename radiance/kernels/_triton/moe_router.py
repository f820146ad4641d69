"""The router of a mixture-of-experts layer at decode sizes: logits [T, E] = x [T, H] @ W [E, H]^T (+ bias).

cuBLAS serves this GEMV with one or two launches (gpt-oss's biased one: a split-K GEMM and its reduce) that
take no part in programmatic dependent launch, so the kernels around them cannot overlap their launches. Here
each program takes BE experts of BT tokens and walks H in BH-wide chunks on the CUDA cores (fp32 sums): a
grid of E x cdiv(T, BT) short programs whose few wide loads are all in flight at once.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff


@triton.jit
def moe_router_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, T, E, H, stride_x, stride_w, stride_o,
                      BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """out[t, e] = sum_h x[t, h] * w[e, h] (+ bias[e]), in fp32, rounded once to out's dtype. Grid
    [cdiv(E, BE), cdiv(T, BT)]."""
    pdl_handoff(PDL)
    experts = tl.program_id(0) * BE + tl.arange(0, BE)
    toks = tl.program_id(1) * BT + tl.arange(0, BT)
    e_live = experts < E
    t_live = toks < T
    offs_h = tl.arange(0, BH)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for h0 in range(0, H, BH):
        h_live = (h0 + offs_h) < H
        x = tl.load(x_ptr + toks.to(tl.int64)[:, None] * stride_x + h0 + offs_h[None, :],
                    mask=t_live[:, None] & h_live[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts.to(tl.int64)[:, None] * stride_w + h0 + offs_h[None, :],
                    mask=e_live[:, None] & h_live[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + experts, mask=e_live, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_o + experts[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_live[:, None] & e_live[None, :])
