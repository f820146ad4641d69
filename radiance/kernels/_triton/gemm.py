"""The W4A8 GEMM: out[M, N] = (x_q[M, K] * x_scale) @ (e2m1 W[N, K] * 2^shift * 2^ref)^T (+ bias).

One kernel serves both bands:
  - prefill: SWAP_AB=False, acc[BM, BN] = x @ w^T with x as the wgmma A operand (BM % 64 == 0) and
    the expanded weight tile as the K-major B operand;
  - decode: SWAP_AB=True, acc[BN, BM] = w @ x^T so the weight rows fill the 64-wide MMA M dimension
    and a handful of tokens the N dimension; K is split over the grid's second axis (SPLIT_K), each
    split writes fp32 partials and `splitk_reduce_kernel` sums them (deterministic, no atomics).
fp8 tl.dot lowers to wgmma on sm_90 with num_warps % 4 == 0. Hopper's fp8 MMA accumulates with
reduced precision (~14 bits); PRECISE_ACC sums each K tile from zero in the MMA and adds it to the fp32
accumulator, which keeps the result within bf16 rounding of the exact fp32 reference (Triton's
max_num_imprecise_acc did not take effect for the register-A swap-AB tiling on Triton 3.6).
"""

import triton
import triton.language as tl

from radiance.kernels._triton.convert import expand_e2m1_tile


@triton.jit
def w4a8_gemm_kernel(x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr,
                     M, N, K, stride_xm, stride_om, k_tiles_per_split,
                     HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT_K: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, PRECISE_ACC: tl.constexpr):
    NB: tl.constexpr = BK // 32
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # grouped order: GROUP_M row tiles walk the N tiles together, so weight tiles are reused from L2
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    # rows past M / N wrap around (their results are never stored), so loads need no row masks
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, NB)
    half_k = K // 2
    nblk = K // 32
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = (w_ptr + offs_n.to(tl.int64)[:, None, None] * half_k + offs_b[None, :, None] * 16
              + tl.arange(0, 16)[None, None, :])
    s_ptrs = shift_ptr + offs_n.to(tl.int64)[:, None] * nblk + offs_b[None, :]

    kt_begin = pid_k * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, tl.cdiv(K, BK))
    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(kt_begin, kt_end):
        if EVEN_K:
            x = tl.load(x_ptrs + kt * BK)
            w3 = tl.load(w_ptrs + kt * (BK // 2))
            s = tl.load(s_ptrs + kt * NB)
        else:
            k_live = (kt * BK + offs_k) < K
            b_live = (kt * NB + offs_b) < nblk
            x = tl.load(x_ptrs + kt * BK, mask=k_live[None, :], other=0.0)
            w3 = tl.load(w_ptrs + kt * (BK // 2), mask=b_live[None, :, None], other=0)
            s = tl.load(s_ptrs + kt * NB, mask=b_live[None, :], other=0)
        w = expand_e2m1_tile(w3, s.to(tl.int32), USE_ASM)
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

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_live = rm < M
    n_live = rn < N
    xs = tl.load(xs_ptr + rm, mask=m_live, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_live, other=0.0)
    acc = acc * xs[:, None] * ws[None, :]
    live = m_live[:, None] & n_live[None, :]
    if SPLIT_K > 1:
        part = part_ptr + pid_k.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=live)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_live, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * M * N + offs, mask=live, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=live)
