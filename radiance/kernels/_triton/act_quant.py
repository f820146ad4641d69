"""Per-token dynamic e4m3 activation quantization, alone and fused into RMSNorm.

One program per token row; the whole row sits in registers (K <= 65536), so x is read once (rows far
from a power of two take two passes over chunks instead of padding).
Math is fp32 with correctly rounded division (divide_by_scale) so the bytes match the torch
reference exactly.

At decode a row is all there is, and one SM needs ~60 instructions per element of SiLU-mul + quantize
(4-6 us for a 14336-wide row). `silu_mul_quant_chunks_kernel` spreads a row over several programs
that agree on the row's amax through a spin barrier (CUDA only: the interpreter runs programs one by
one, so a barrier would never open).
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))


@triton.jit
def round_to_e4m3_grid(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even, staying in fp32.

    The Triton interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a power of two
    (124.3 -> 64 instead of 128); pre-rounding makes the cast exact there. The GPU's cvt is correct.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share the 2^-6 exponent
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    t = v / ulp  # exact: power-of-two divisor
    r = (tl.abs(t) + 8388608.0) - 8388608.0  # round half to even on |t| < 2^23
    return tl.where(t < 0, -r, r) * ulp


@triton.jit
def divide_by_scale(x, scale, INTERPRETER: tl.constexpr):
    """x / scale correctly rounded (IEEE), with scale one fp32 scalar per row.

    On the GPU: q0 = x * RN(1/scale), then one FMA correction, q0 + RN(x - q0 * scale) * RN(1/scale),
    which is the correctly rounded quotient whenever q0 is within an ulp of it and nothing over- or
    underflows (Markstein); here |x / scale| <= 448 * (1 + 2^-23), and fp32-denormal x quantize to
    zero either way. Three instructions instead of div.rn's ~10 with a slow-path call per element.
    A row whose scale is inf (it holds an inf) takes q0: finite / inf = 0, inf / inf = NaN, as IEEE.
    The interpreter's fma is not fused, so there the division is plain div_rn."""
    if INTERPRETER:
        return tl.math.div_rn(x, scale)
    inv = tl.math.div_rn(1.0, scale)
    q0 = x * inv
    q1 = tl.fma(tl.fma(-q0, scale, x), inv, q0)
    return tl.where(scale == float("inf"), q0, q1)


@triton.jit
def pdl_handoff(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """First statement of a kernel launched as a programmatic dependent (launch_pdl, sm_90+): wait
    until the kernel before it has finished and its writes are visible (it may have been launched
    while that kernel ran, which hides the launch), then let the kernel after this one launch in
    turn (a GEMM prefetches its weights meanwhile). Nothing may be read or written before the wait
    (but by the LoRA kernels, which read what the kernel before them does not write: radiance.kernels.lora).
    EARLY lets the kernel after this one launch before the wait, i.e. while the kernel before this
    one still runs (it still waits for this one's completion before it reads). It cannot starve this
    kernel of SM room: the dependents launch only once every CTA of this kernel has issued the release,
    i.e. is already resident."""
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _row_scale(amax, has_nan):
    """A token's scale from its amax: max(amax / 448, 1 / (448 * 512)); NaN when the token holds a
    NaN (max() may drop NaNs, so the caller counts them), so that its outputs show it."""
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    return tl.where(has_nan, float("nan"), scale)


@triton.jit
def _to_e4m3(x, scale, INTERPRETER: tl.constexpr):
    """x / scale, clamped to +-448 (NaN kept), as e4m3."""
    q = tl.clamp(divide_by_scale(x, scale, INTERPRETER), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if INTERPRETER:
        q = round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _quantize_row(x, mask, xq_ptrs, scale_ptr, INTERPRETER: tl.constexpr):
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    scale = _row_scale(amax, tl.sum((x != x).to(tl.int32), axis=0) > 0)
    tl.store(xq_ptrs, _to_e4m3(x, scale, INTERPRETER), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr,
                         INTERPRETER: tl.constexpr, PDL: tl.constexpr = False):
    pdl_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, mask, xq_ptr + row * K + offs, scale_ptr + row, INTERPRETER)


@triton.jit
def quantize_rows_chunked_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr,
                                 INTERPRETER: tl.constexpr, PDL: tl.constexpr = False):
    """quantize_rows_kernel for rows far from a power of two (17408 would pad to 32768): two passes
    over BLOCK-wide chunks, the amax first, then the division; the second read hits the cache."""
    pdl_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    nans = tl.zeros([BLOCK], tl.int32)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(x), 0.0))
        nans += (x != x).to(tl.int32)
    scale = _row_scale(tl.max(amax, axis=0), tl.sum(nans, axis=0) > 0)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(xq_ptr + row * K + start + offs, _to_e4m3(x, scale, INTERPRETER), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def add_rmsnorm_rows_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, xq_ptr, scale_ptr, K, stride_xm, stride_rm,
                            eps, stride_part=0, HAS_RESIDUAL: tl.constexpr = True, QUANT: tl.constexpr = False,
                            PARTS: tl.constexpr = 0, BLOCK: tl.constexpr = 1024, INTERPRETER: tl.constexpr = False,
                            PDL: tl.constexpr = False, KEEP_VALUES: tl.constexpr = False,
                            EARLY_RELEASE: tl.constexpr = False):
    """The pre-norm step of a decoder layer in one pass, with the model's rounding:
    s = x + residual (rounded to x's dtype, written to res_out), y = weight * rms_norm(s) (normalized in
    fp32, rounded to x's dtype, multiplied by the weight in x's dtype); then y is written (out) or
    quantized per token to e4m3 (xq, scale) for a W4A8 linear, or with KEEP_VALUES both (a sparse MLP: its
    router reads y, its experts the e4m3 codes). With PARTS > 0, x is a W4A8 GEMM's fp32
    split-K partials [PARTS, M, stride_xm] (norm.PartialSums), summed here in split order and
    rounded to res_out's dtype as the GEMM would have; unrolled, so that all their loads are in flight
    at once (a loop over them waited an L2 round trip per partial: the 32B's decode step +145 us)."""
    pdl_handoff(PDL, EARLY_RELEASE)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if PARTS > 0:
        total = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(PARTS):
            total += tl.load(x_ptr + k * stride_part + row * stride_xm + offs, mask=mask, other=0.0)
        x_raw = total.to(res_out_ptr.dtype.element_ty)
    else:
        x_raw = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rm + offs, mask=mask, other=0.0)
        x_raw = (x_raw.to(tl.float32) + r.to(tl.float32)).to(x_raw.dtype)
        tl.store(res_out_ptr + row * K + offs, x_raw, mask=mask)
    x = x_raw.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / K
    normed = (x * tl.math.rsqrt(mean_sq + eps)).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(x_raw.dtype).to(tl.float32)
    y = (w * normed).to(x_raw.dtype)
    if QUANT:
        _quantize_row(y.to(tl.float32), mask, xq_ptr + row * K + offs, scale_ptr + row, INTERPRETER)
    if KEEP_VALUES or not QUANT:
        tl.store(out_ptr + row * K + offs, y, mask=mask)


@triton.jit
def silu_mul_values(g, u, dtype: tl.constexpr):
    """silu(g) * u with torch's rounding in `dtype` (g, u: fp32 holding dtype values): silu in fp32,
    rounded, times u, rounded. The one definition the SiLU kernels and the GLU GEMM epilogue share."""
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """v rounded to dtype, back in fp32: the result of one torch op in dtype."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def swiglu_oai_values(g, u, dtype: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """gpt-oss's clamped SwiGLU, (clamp(u, -LIMIT, LIMIT) + 1) * (gc * sigmoid(gc * ALPHA)) with
    gc = min(g, LIMIT), rounded in `dtype` after each op as HF's torch code is (g, u: fp32 holding dtype
    values; glu.glu_reference). The clamps keep NaN, as torch.clamp does."""
    g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    u = tl.clamp(u, -LIMIT, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    sig = _rounded(1.0 / (1.0 + tl.exp(-_rounded(g * ALPHA, dtype))), dtype)
    return (_rounded(u + 1.0, dtype) * _rounded(g * sig, dtype)).to(dtype)


@triton.jit
def gelu_tanh_mul_values(g, u, dtype: tl.constexpr):
    """gelu(g, approximate="tanh") * u with torch's rounding in `dtype` (g, u: fp32 holding dtype values): torch's
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in fp32, rounded, times u, rounded. tanh(z) is
    sign(z) (1 - e^-2|z|) / (1 + e^-2|z|), accurate to a few ulp as tanhf is (and Triton's interpreter runs it);
    where 1 + tanh cancels (g below about -2.5) the result can differ from torch's by an ulp of 1 times g / 2."""
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = tl.exp(-2.0 * tl.abs(inner))
    tanh = (1.0 - t) / (1.0 + t)
    tanh = tl.where(inner < 0, -tanh, tanh)
    act = (0.5 * g * (1.0 + tanh)).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def _silu_mul(gu_ptr, row, offs, mask, stride_m, I, bias_ptr, expert_ptr, HAS_BIAS: tl.constexpr,
              ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act(gate, up) with torch's rounding, in the input dtype: silu(gate) * up (ACT 0), gpt-oss's clamped
    SwiGLU (ACT 1) or Gemma's GeGLU (ACT 2; glu.GLU_KINDS). HAS_BIAS: the row's expert bias (bias [E, 2I], the row's expert at
    expert_ptr[row]) is added to gate and up first, rounded as torch's add would be."""
    g_raw = tl.load(gu_ptr + row * stride_m + offs, mask=mask, other=0.0)
    u_raw = tl.load(gu_ptr + row * stride_m + I + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        b_row = bias_ptr + tl.load(expert_ptr + row).to(tl.int64) * (2 * I)
        g_raw = (g_raw.to(tl.float32) + tl.load(b_row + offs, mask=mask, other=0.0)).to(g_raw.dtype)
        u_raw = (u_raw.to(tl.float32) + tl.load(b_row + I + offs, mask=mask, other=0.0)).to(u_raw.dtype)
    if ACT == 0:
        return silu_mul_values(g_raw.to(tl.float32), u_raw.to(tl.float32), g_raw.dtype)
    if ACT == 2:
        return gelu_tanh_mul_values(g_raw.to(tl.float32), u_raw.to(tl.float32), g_raw.dtype)
    return swiglu_oai_values(g_raw.to(tl.float32), u_raw.to(tl.float32), g_raw.dtype, ALPHA, LIMIT)


@triton.jit
def arrive_and_wait(count_ptr, parties):
    """Counts this program in at count_ptr and waits until all `parties` programs (resident at once) have arrived.
    The int64 count only grows (one round adds `parties`), so nothing is reset between rounds or launches: one
    counter per party count."""
    before = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    target = (before // parties + 1) * parties
    seen = before + 1
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def shared_row_scale(slots_ptr, count_ptr, row, part, local_amax, has_nan, parties, P_PAD: tl.constexpr):
    """The scale of a row spread over `parties` resident programs (part = this program's index).
    Each writes its part's amax to its slot (as int32 bits: non-negative floats order like their
    bits, and a NaN, 0x7FC00000, beats every amax, so a row holding one gets a NaN scale as in
    _quantize_row), counts itself in, waits until the count reaches the next multiple of `parties`,
    and takes the max of the row's slots (arrive_and_wait: one counter array per party count,
    triton_support.row_barrier_buffers)."""
    bits = tl.where(has_nan, 0x7FC00000, local_amax.to(tl.int32, bitcast=True))
    tl.store(slots_ptr + row * parties + part, bits)
    arrive_and_wait(count_ptr + row, parties)  # its arrival releases the slot store
    offs = tl.arange(0, P_PAD)
    slots = tl.load(slots_ptr + row * parties + offs, mask=offs < parties, other=0, cache_modifier=".cg")
    row_bits = tl.max(slots, axis=0)
    return _row_scale(row_bits.to(tl.float32, bitcast=True), row_bits == 0x7FC00000)


@triton.jit
def silu_mul_quant_chunks_kernel(gu_ptr, xq_ptr, scale_ptr, slots_ptr, count_ptr, bias_ptr, expert_ptr, I, stride_m,
                                 BLOCK: tl.constexpr, C_PAD: tl.constexpr, PDL: tl.constexpr = False,
                                 HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 1.702,
                                 LIMIT: tl.constexpr = 7.0):
    """silu_mul_rows_kernel with QUANT, one row over cdiv(I, BLOCK) programs (grid [chunks, M]), all
    resident at once (the launcher keeps the grid small). The programs of a row agree on its scale
    through shared_row_scale, then each quantizes its own chunk."""
    pdl_handoff(PDL)  # every program is resident before a dependent can start
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    chunks = tl.num_programs(0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    y = _silu_mul(gu_ptr, row, offs, mask, stride_m, I, bias_ptr, expert_ptr, HAS_BIAS, ACT, ALPHA,
                  LIMIT).to(tl.float32)
    local = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    has_nan = tl.sum((y != y).to(tl.int32), axis=0) > 0
    scale = shared_row_scale(slots_ptr, count_ptr, row, chunk, local, has_nan, chunks, C_PAD)
    tl.store(xq_ptr + row * I + offs, _to_e4m3(y, scale, False), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


@triton.jit
def silu_mul_rows_kernel(gu_ptr, out_ptr, xq_ptr, scale_ptr, I, stride_m, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                         INTERPRETER: tl.constexpr, PDL: tl.constexpr = False, bias_ptr=None, expert_ptr=None,
                         HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 1.702,
                         LIMIT: tl.constexpr = 7.0):
    """y = silu(gate) * up for gate_up = [gate | up] (each I wide), rounded like torch in the input
    dtype (silu computed in fp32, then rounded; the product rounded); written, or quantized per token.
    ACT 1: gpt-oss's clamped SwiGLU instead (ALPHA, LIMIT), with torch's roundings too; HAS_BIAS: _silu_mul's."""
    pdl_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    y = _silu_mul(gu_ptr, row, offs, mask, stride_m, I, bias_ptr, expert_ptr, HAS_BIAS, ACT, ALPHA, LIMIT)
    if QUANT:
        _quantize_row(y.to(tl.float32), mask, xq_ptr + row * I + offs, scale_ptr + row, INTERPRETER)
    else:
        tl.store(out_ptr + row * I + offs, y, mask=mask)


@triton.jit
def quantize_rows_from_parts_kernel(y_ptr, parts_ptr, xq_ptr, scale_ptr, K, n_parts, stride_ym,
                                    BLOCK: tl.constexpr, P_PAD: tl.constexpr, INTERPRETER: tl.constexpr,
                                    PDL: tl.constexpr = False, EARLY_RELEASE: tl.constexpr = False):
    """quantize_rows_kernel for rows whose amax the kernel before already found in parts: int32 bits
    [M, n_parts] (|y| maxima of column tiles, written by the GLU GEMM). Grid [M * cdiv(K, BLOCK)] (one axis:
    a grouped MoE GEMM's rows can pass the 65535 programs of a second grid axis): every program takes its
    row's scale from the parts (no barrier, no second pass) and quantizes one chunk."""
    pdl_handoff(PDL, EARLY_RELEASE)
    chunks = tl.cdiv(K, BLOCK)
    chunk = tl.program_id(0) % chunks
    row = (tl.program_id(0) // chunks).to(tl.int64)
    offs_p = tl.arange(0, P_PAD)
    bits = tl.max(tl.load(parts_ptr + row * n_parts + offs_p, mask=offs_p < n_parts, other=0), axis=0)
    scale = _row_scale(bits.to(tl.float32, bitcast=True), bits > 0x7F800000)  # above inf's bits: a NaN
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    y = tl.load(y_ptr + row * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(xq_ptr + row * K + offs, _to_e4m3(y, scale, INTERPRETER), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)
