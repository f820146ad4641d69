"""The W4A8 GEMM: out[M, N] = (x_q[M, K] * x_scale) @ (e2m1 W[N, K] * 2^shift * 2^ref)^T (+ bias).

One kernel serves both bands:
  - prefill: SWAP_AB=False, acc[BM, BN] = x @ w^T with x as the wgmma A operand (BM % 64 == 0) and
    the expanded weight tile as the K-major B operand;
  - decode: SWAP_AB=True, acc[BN, BM] = w @ x^T so the weight rows fill the 64-wide MMA M dimension
    and a handful of tokens the N dimension; K is split over the grid's second axis (`splits`, a
    run-time count: one compile serves every split), each split writes fp32 partials, and the last
    split of a tile to finish (an atomic counter per tile) sums them in split order: deterministic,
    and one launch per linear; or, with DEFER_SUM, the kernel that reads the output sums them.
With DEPENDENT the kernel is launched as a programmatic dependent (sm_90): it prefetches its first
PDL_PREFETCH weight tiles into L2 while the kernel that quantizes x still runs, then waits for it
(gdc_wait), then lets the kernel after it launch (that kernel waits for this one's completion before it
reads).
fp8 tl.dot lowers to wgmma on sm_90 with num_warps % 4 == 0. Hopper's fp8 MMA accumulates with
reduced precision (~14 bits); PRECISE_ACC sums each K tile from zero in the MMA and adds it to the fp32
accumulator, which keeps the result within bf16 rounding of the exact fp32 reference (Triton's
max_num_imprecise_acc did not take effect for the register-A swap-AB tiling on Triton 3.6).

With GLU the weight is a merged [gate | up] linear (N = 2I rows) and the kernel writes
y = silu(gate) * up [M, I] instead: output tile j multiplies gate rows j*BN/2.. and the up rows I
apart from them, interleaved by 8 so that both halves of an output meet in one thread's accumulator.
The epilogue rounds each half to the output dtype, then applies silu_mul_values: the bytes of the GEMM
then silu_mul. Each tile also stores its rows' amax (int32 bits) to amax_ptr [M, tiles], from which
act_quant.quantize_rows_from_parts_kernel takes each token's scale: no SiLU launch in between.
The grouped MoE GEMM (moe_gemm.py) may pick gpt-oss's clamped SwiGLU instead (_epilogue's ACT); this
kernel keeps the default, silu.
"""

import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import gelu_tanh_mul_values, silu_mul_values, swiglu_oai_values
from radiance.kernels._triton.convert import expand_e2m1_words, live_words


@triton.jit
def _unpack_shifts(s):
    """int32 [BN, G] holding 4 int8 block shifts each -> int32 [BN, 4G] in block order. Built with
    joins, which Triton's layout pass carries through to the MMA operand (a broadcast + reshape sent
    the expanded tile through shared memory)."""
    b0 = (s << 24) >> 24  # arithmetic shifts sign-extend each byte
    b1 = (s << 16) >> 24
    b2 = (s << 8) >> 24
    b3 = s >> 24
    both = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [BN, G, 2, 2]: [.., i, j] = byte 2i + j
    return tl.reshape(both, (s.shape[0], s.shape[1] * 4))


@triton.jit
def live_k(kt, K, BK: tl.constexpr):
    """[BK] mask of K tile kt's columns below K. K is a multiple of 32 (the MXFP4 block), so the mask is constant
    over 32 columns and fp8 loads stay 16-byte vectors (a per-column mask made them byte loads)."""
    return (kt * BK + tl.arange(0, BK) // 32 * 32) < K


@triton.jit
def _tile_columns(pid_n, N, BN: tl.constexpr, GLU: tl.constexpr):
    """(output columns [BN or BN/2], weight rows [BN], output width) of column tile pid_n. Rows past
    the weight wrap around (their results are never stored), so weight loads need no row mask."""
    if GLU:
        # accumulator rows r and r + 8 of each 16 sit in one thread of the wgmma layout (swap-AB), so
        # they carry the gate and the up row of one output column: the epilogue pairs them in registers
        HALF: tl.constexpr = BN // 2
        out_n = N // 2
        r = tl.arange(0, BN)
        cols = pid_n * HALF + tl.arange(0, HALF)
        col_of_row = pid_n * HALF + (r >> 4) * 8 + (r & 7)
        rows = col_of_row % out_n + ((r >> 3) & 1) * out_n
    else:
        out_n = N
        cols = pid_n * BN + tl.arange(0, BN)
        rows = cols % N
    return cols, rows, out_n


@triton.jit
def _glu_values(gate, up, dtype: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act(gate, up) in dtype for ACT 0 silu, 1 swiglu_oai, 2 gelu_tanh (glu.GLU_KINDS; ALPHA and LIMIT:
    swiglu_oai's)."""
    if ACT == 0:
        y = silu_mul_values(gate, up, dtype)
    elif ACT == 2:
        y = gelu_tanh_mul_values(gate, up, dtype)
    else:
        y = swiglu_oai_values(gate, up, dtype, ALPHA, LIMIT)
    return y


@triton.jit
def _store_glu(out_ptr, amax_ptr, v, rm, m_live, cols, out_n, stride_om, num_pid_n, pid_n,
               BM: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """y = act(gate, up) (_glu_values) of a [BM, BN] tile whose columns alternate 8 gate and 8 up (fp32 with
    scales and bias; _tile_columns), stored [BM, BN/2]; and each row's amax of |y| as int32 bits (non-negative
    floats order like their bits; NaN bits exceed inf's, so a NaN survives the max) to amax_ptr[row, pid_n]."""
    v = v.to(out_ptr.dtype.element_ty).to(tl.float32)  # the GEMM's rounding of gate and up
    gate, up = tl.split(tl.permute(tl.reshape(v, (BM, BN // 16, 2, 8)), (0, 1, 3, 2)))  # see _tile_columns
    y = tl.reshape(_glu_values(gate, up, out_ptr.dtype.element_ty, ACT, ALPHA, LIMIT), (BM, BN // 2))
    live = m_live[:, None] & (cols < out_n)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + cols[None, :], y, mask=live)
    bits = tl.where(live, tl.abs(y.to(tl.float32)).to(tl.int32, bitcast=True), 0)
    tl.store(amax_ptr + rm.to(tl.int64) * num_pid_n + pid_n, tl.max(bits, axis=1), mask=m_live)


@triton.jit
def _epilogue(out_ptr, amax_ptr, bias_ptr, v, rm, m_live, cols, w_rows, out_n, stride_om, num_pid_n, pid_n,
              HAS_BIAS: tl.constexpr, GLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              ACT: tl.constexpr = 0, ALPHA: tl.constexpr = None, LIMIT: tl.constexpr = None):
    """The tile's fp32 sum v [BM, BN] (scaled) plus the bias of its weight rows, stored in the output dtype
    (or, with GLU, as act(gate, up) with its row amax: ACT 0 silu, 1 swiglu_oai with ALPHA and LIMIT)."""
    if HAS_BIAS:
        v += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    if GLU:
        _store_glu(out_ptr, amax_ptr, v, rm, m_live, cols, out_n, stride_om, num_pid_n, pid_n, BM, BN,
                   ACT, ALPHA, LIMIT)
    else:
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, v.to(out_ptr.dtype.element_ty), mask=m_live[:, None] & (cols < out_n)[None, :])


@triton.jit
def w4a8_gemm_kernel(x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, amax_ptr,
                     M, N, K, stride_xm, stride_om, k_tiles_per_split, splits,
                     HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, PRECISE_ACC: tl.constexpr,
                     DEPENDENT: tl.constexpr = False, PDL_PREFETCH: tl.constexpr = 0, GLU: tl.constexpr = False,
                     DEFER_SUM: tl.constexpr = False, ACT: tl.constexpr = 0):
    """A program per (output tile, K split): grid [tiles, splits]. ACT: the GLU's activation (0 silu, 2 gelu_tanh)."""
    w4a8_gemm_tile(tl.program_id(0), tl.program_id(1), x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr,
                   part_ptr, lock_ptr, amax_ptr, M, N, K, stride_xm, stride_om, k_tiles_per_split, splits,
                   HAS_BIAS, SWAP_AB, SPLIT, BM, BN, BK, GROUP_M, EVEN_K, USE_ASM, PRECISE_ACC, DEPENDENT,
                   PDL_PREFETCH, GLU, DEFER_SUM, ACT)


@triton.jit
def w4a8_gemm_tile(pid, pid_k, x_ptr, xs_ptr, w_ptr, shift_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                   amax_ptr, M, N, K, stride_xm, stride_om, k_tiles_per_split, splits,
                   HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, PRECISE_ACC: tl.constexpr,
                   DEPENDENT: tl.constexpr, PDL_PREFETCH: tl.constexpr, GLU: tl.constexpr, DEFER_SUM: tl.constexpr,
                   ACT: tl.constexpr):
    """Output tile `pid` (grouped order), K split `pid_k`: what one program of w4a8_gemm_kernel computes, callable
    from a kernel that walks several tiles (a persistent one)."""
    NB: tl.constexpr = BK // 32
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N // 2, BN // 2) if GLU else tl.cdiv(N, BN)
    # grouped order: GROUP_M row tiles walk the N tiles together, so weight tiles are reused from L2
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    # token rows past M are masked: at decode M is often far below the tile (1 of 16 rows)
    x_rows = pid_m * BM + tl.arange(0, BM)
    x_live = x_rows < M
    offs_m = x_rows % M
    cols, offs_n, out_n = _tile_columns(pid_n, N, BN, GLU)
    offs_k = tl.arange(0, BK)
    G: tl.constexpr = BK // 128  # 128-k word groups per K tile (prepare.py: 16 words, q-major)
    offs_g = tl.arange(0, G)
    groups = tl.cdiv(K, 128)
    words_per_row = groups * 16
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # a 2-D tile [BN, BK/8] so that Triton spreads each row over 4 threads (16 B each): one thread per
    # row would write its 64 B into shared memory with 4-way bank conflicts
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + tl.arange(0, BK // 8)[None, :]
    # shifts are int8 [K/128, N, 4], read as one int32 per (row, 128-k group): a load of at least 4 B
    # per thread is what Triton's pipeliner turns into cp.async (an int8 load stalled every iteration)
    s_ptrs = shift_ptr + offs_g[None, :].to(tl.int64) * N + offs_n[:, None]  # [BN, G]

    kt_begin = pid_k * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, tl.cdiv(K, BK))
    if DEPENDENT:
        # launched as a programmatic dependent (launch_pdl): the CTA may start while the kernel that
        # writes x still runs. The weights do not depend on it, so pull the first PDL_PREFETCH K tiles
        # of each row into L2 now (one bulk prefetch per row), then wait for the producer's writes.
        if PDL_PREFETCH > 0:
            n_bytes = tl.minimum(kt_end - kt_begin, PDL_PREFETCH) * (BK // 2)
            rows = w_ptr + offs_n.to(tl.int64) * words_per_row + kt_begin * (BK // 8)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [rows, tl.full([BN], 0, tl.int32) + n_bytes], dtype=tl.int32, is_pure=False,
                                      pack=1)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel (norm, rotary, SiLU) may launch and wait
    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(kt_begin, kt_end):
        if EVEN_K:
            x = tl.load(x_ptrs + kt * BK, mask=x_live[:, None], other=0.0)
            words = tl.load(w_ptrs + kt * (BK // 8), eviction_policy="evict_first")  # read once: keep L2 for the rest
            s = tl.load(s_ptrs + kt * G * N)
        else:
            x = tl.load(x_ptrs + kt * BK, mask=x_live[:, None] & live_k(kt, K, BK)[None, :], other=0.0)
            words = tl.load(w_ptrs + kt * (BK // 8), mask=live_words(kt, groups, BK)[None, :], other=0,
                            eviction_policy="evict_first")
            group_live = (kt * G + offs_g) < groups
            s = tl.load(s_ptrs + kt * G * N, mask=group_live[None, :], other=0)
        words = tl.reshape(tl.permute(tl.reshape(words, (BN, G, 4, 4)), (0, 1, 3, 2)), (BN, NB, 4))  # [BN, block, q]
        w = expand_e2m1_words(words, _unpack_shifts(s), USE_ASM)
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
    m_live = rm < M
    xs = tl.load(xs_ptr + rm, mask=m_live, other=0.0)
    ws = tl.load(ws_ptr + offs_n)
    acc = acc * xs[:, None] * ws[None, :]
    if SPLIT:
        # partials [splits, M, num_pid_n * BN]: a tile's BN accumulator columns, whatever they hold
        width = num_pid_n * BN
        part = part_ptr + rm.to(tl.int64)[:, None] * width + (pid_n * BN + tl.arange(0, BN))[None, :]
        tl.store(part + pid_k.to(tl.int64) * M * width, acc, mask=m_live[:, None])
        if not DEFER_SUM:
            # the split that arrives last sums all partials, in split order (deterministic), and re-arms
            # the tile's counter for the next launch; no second kernel. With DEFER_SUM the consumer of the
            # output sums them as it reads (norm.PartialSums): the CTA ends here, without the
            # fence, atomic and reload of the last arrival (~1 us per GEMM at decode)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for k in range(splits):  # .cg: read L2, where the other CTAs' partials are
                    total += tl.load(part + k * M * width, mask=m_live[:, None], other=0.0, cache_modifier=".cg")
                _epilogue(out_ptr, amax_ptr, bias_ptr, total, rm, m_live, cols, offs_n, out_n, stride_om,
                          num_pid_n, pid_n, HAS_BIAS, GLU, BM, BN, ACT)
                tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")
    else:
        _epilogue(out_ptr, amax_ptr, bias_ptr, acc, rm, m_live, cols, offs_n, out_n, stride_om,
                  num_pid_n, pid_n, HAS_BIAS, GLU, BM, BN, ACT)
