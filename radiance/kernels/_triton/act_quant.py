"""Per-token dynamic e4m3 activation quantization, alone and fused into RMSNorm.

One program per token row; the whole row sits in registers (K <= 65536), so x is read once.
Math is fp32 with IEEE division (div_rn) so the bytes match the torch reference exactly.
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
def _quantize_row(x, mask, xq_ptrs, scale_ptr, ROUND_IN_FP32: tl.constexpr):
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    # max() may drop NaNs: a token holding one gets a NaN scale, so its outputs show it
    has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
    scale = tl.where(has_nan, float("nan"), scale)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_IN_FP32:
        q = round_to_e4m3_grid(q)
    tl.store(xq_ptrs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr,
                         ROUND_IN_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, mask, xq_ptr + row * K + offs, scale_ptr + row, ROUND_IN_FP32)


@triton.jit
def add_rmsnorm_rows_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, xq_ptr, scale_ptr, K, stride_xm, stride_rm,
                            eps, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                            ROUND_IN_FP32: tl.constexpr):
    """The pre-norm step of a decoder layer in one pass, with the model's rounding:
    s = x + residual (rounded to x's dtype, written to res_out), y = weight * rms_norm(s) (normalized in
    fp32, rounded to x's dtype, multiplied by the weight in x's dtype); then y is written (out) or
    quantized per token to e4m3 (xq, scale) for a W4A8 linear."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
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
        _quantize_row(y.to(tl.float32), mask, xq_ptr + row * K + offs, scale_ptr + row, ROUND_IN_FP32)
    else:
        tl.store(out_ptr + row * K + offs, y, mask=mask)


@triton.jit
def silu_mul_rows_kernel(gu_ptr, out_ptr, xq_ptr, scale_ptr, I, stride_m, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                         ROUND_IN_FP32: tl.constexpr):
    """y = silu(gate) * up for gate_up = [gate | up] (each I wide), rounded like torch in the input
    dtype (silu computed in fp32, then rounded; the product rounded); written, or quantized per token."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    g_raw = tl.load(gu_ptr + row * stride_m + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_m + I + offs, mask=mask, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(g_raw.dtype).to(tl.float32)
    y = (act * u).to(g_raw.dtype)
    if QUANT:
        _quantize_row(y.to(tl.float32), mask, xq_ptr + row * I + offs, scale_ptr + row, ROUND_IN_FP32)
    else:
        tl.store(out_ptr + row * I + offs, y, mask=mask)
