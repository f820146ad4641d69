"""The Gated DeltaNet prefill in the chunked form (layers/gated_delta._chunked on the GPU). NOT on the serving path:
on an H100 at Qwen3.5-9B's heads it took 6.2-6.5 us a token a layer against the recurrent form's 1.2-1.5
(gated_delta_prefill.recurrent_prefill; bench/RESULTS.md, sixty-sixth session), correct to the reference on the
GPU all the same. Kept as the start of the tensor-core version: its launch 1 (a 63-step forward substitution over
a 64 x 64 tile of where-masks) and fp32 FMA products are the suspects, not profiled yet.

layers/gated_delta._chunked on the GPU: each sequence cut into CHUNK-token chunks. Launch 1, every (chunk, value
head) at once: the chunk's decays, its delta-rule interactions A = strictly_lower(beta K K^T * decay) folded into
T = (I + A)^-1 by forward substitution (row by row: exact, as the reference's triangular solve), then W = T (K beta
exp(cum)), U = T (V beta) and the chunk's own attention (Q K^T * decay, diagonal included). Launch 2, every
(sequence, value head, block_v state columns): the scan over the sequence's chunks with the state in registers,
V_new = U - W S, O = (Q exp(cum)) S + attn V_new, S = exp(cum_last) S + (K exp(cum_last - cum))^T V_new.
Matrix products in fp32 by default (input_precision ieee: on the CUDA cores; tf32x3 takes the tensor cores).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.gated_delta import _next_pow2
from radiance.kernels._triton.gated_delta_prefill import _check_prefill_inputs


CHUNK = 64


class DeltaChunks(NamedTuple):
    """Where each chunk lies: first token and length per chunk ([N] int32), each sequence's first chunk ([B + 1]
    int32); `count` N on the host (the launch grid)."""

    starts: torch.Tensor
    lens: torch.Tensor
    first_chunk: torch.Tensor
    count: int


def delta_chunks(q_lens: list[int], device: torch.device, chunk: int = CHUNK) -> DeltaChunks:
    """The chunks of sequences of `q_lens` tokens back to back (a 0-token sequence has none)."""
    starts, lens, first = [], [], [0]
    offset = 0
    for n in q_lens:
        for c in range(0, n, chunk):
            starts.append(offset + c)
            lens.append(min(chunk, n - c))
        first.append(len(starts))
        offset += n
    table = torch.tensor([starts, lens], dtype=torch.int32).to(device, non_blocking=True)
    return DeltaChunks(table[0], table[1], torch.tensor(first, dtype=torch.int32).to(device, non_blocking=True),
                       len(starts))


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, state_slots: torch.Tensor, chunks: DeltaChunks, continues: torch.Tensor,
                    scale: float | None = None, block_v: int = 32, precision: str = "ieee",
                    num_warps: int = 8) -> torch.Tensor:
    """recurrent_prefill's result in the chunked form (same arguments, the chunk table `chunks` in place of
    cu_seqlens: delta_chunks(q_lens)). Head dims below 16 (tl.dot's least) are padded with zeros. Scratch: (Dk + Dv
    + CHUNK) fp32 values a token and value head. precision: tl.dot's input_precision ("ieee": fp32 products on the
    CUDA cores; "tf32x3": three tf32 tensor-core products, about fp32's accuracy; "tf32"), num_warps: both launches'
    (tools/gated_delta_prefill_sweep.py times them)."""
    if precision not in ("ieee", "tf32x3", "tf32"):
        raise ValueError(f"chunked_prefill: precision ieee, tf32x3 or tf32, got {precision!r}")
    _check_prefill_inputs("chunked_prefill", q, k, v, g, beta, state, state_slots, continues)
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    if chunks.first_chunk.shape != (B + 1,):
        raise ValueError(f"chunked_prefill: a chunk table of {chunks.first_chunk.shape[0] - 1} sequences for {B}")
    block_k, block_dv = max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))  # tl.dot's least: zeros pad the rest
    if block_k > 256 or block_dv > 256 or block_v & (block_v - 1):
        raise ValueError(f"chunked_prefill: Dk and Dv up to 256 (got {Dk}, {Dv}), block_v a power of two")
    out = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return out
    scale = Dk ** -0.5 if scale is None else float(scale)
    continues = continues if continues.dtype == torch.int32 else continues.to(torch.int32)
    w = torch.empty((chunks.count, Hv, CHUNK, block_k), dtype=torch.float32, device=v.device)
    u = torch.empty((chunks.count, Hv, CHUNK, block_dv), dtype=torch.float32, device=v.device)
    attn = torch.empty((chunks.count, Hv, CHUNK, CHUNK), dtype=torch.float32, device=v.device)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
               beta.stride(0))
    if chunks.count:
        chunk_prepare_kernel[(chunks.count, Hv)](q, k, v, g, beta, chunks.starts, chunks.lens, w, u, attn, scale, Dk,
                                                 Dv, *strides, HV=Hv, GROUP=Hv // Hk, C=CHUNK, BLOCK_K=block_k,
                                                 BLOCK_DV=block_dv, PRECISION=precision, num_warps=num_warps)
    block_v = max(16, min(block_v, block_dv))
    chunk_scan_kernel[(B * Hv, triton.cdiv(Dv, block_v))](
        q, k, g, w, u, attn, state, state_slots, chunks.starts, chunks.lens, chunks.first_chunk, continues, out,
        scale, Dk, Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), state.stride(0),
        state.stride(1), state.stride(2), HV=Hv, GROUP=Hv // Hk, C=CHUNK, BLOCK_K=block_k, BLOCK_DV=block_dv,
        BLOCK_V=block_v, PRECISION=precision, num_warps=num_warps)
    return out


@triton.jit
def _load_rows(ptr, row0, n, stride_t, cols, n_cols, C: tl.constexpr):
    """Rows row0 .. row0 + n of a [T, ...] tensor (row stride stride_t), columns `cols`; zeros past n / n_cols."""
    r = tl.arange(0, C)
    mask = (r[:, None] < n) & (cols[None, :] < n_cols)
    return tl.load(ptr + (row0 + r[:, None]).to(tl.int64) * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _normalized(x):
    return x * tl.math.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def chunk_prepare_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, starts_ptr, lens_ptr, w_ptr, u_ptr, attn_ptr, scale,
                         Dk, Dv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                         stride_bt, HV: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """Grid [chunks, HV]: W [C, BLOCK_K], U [C, BLOCK_DV], attn [C, C] of value head h in chunk c."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    t0 = tl.load(starts_ptr + c)
    n = tl.load(lens_ptr + c)
    r = tl.arange(0, C)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_DV)
    k = _normalized(_load_rows(k_ptr + hk * stride_kh, t0, n, stride_kt, dk, Dk, C).to(tl.float32))
    q = _normalized(_load_rows(q_ptr + hk * stride_qh, t0, n, stride_qt, dk, Dk, C).to(tl.float32)) * scale
    v = _load_rows(v_ptr + h * stride_vh, t0, n, stride_vt, dv, Dv, C).to(tl.float32)
    live = r < n
    g = tl.load(g_ptr + (t0 + r).to(tl.int64) * stride_gt + h, mask=live, other=0.0)
    beta = tl.load(beta_ptr + (t0 + r).to(tl.int64) * stride_bt + h, mask=live, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    lower = r[:, None] >= r[None, :]
    decay = tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION) * decay
    a = tl.where(r[:, None] > r[None, :], a, 0.0)
    # T = (I + A)^-1, A strictly lower: row i of T is e_i - sum_{j < i} A_ij T_j (rows j >= i are still e_j, and
    # A_ij = 0 there)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
        row = tl.where(r == i, 1.0, -tl.sum(a_i[:, None] * t, axis=0))
        t = tl.where(r[:, None] == i, row[None, :], t)
    w = tl.dot(t, k * (beta * tl.exp(cum))[:, None], input_precision=PRECISION)
    u = tl.dot(t, v * beta[:, None], input_precision=PRECISION)
    attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
    base = (c * HV + h).to(tl.int64) * C
    tl.store(w_ptr + (base + r[:, None]) * BLOCK_K + dk[None, :], w)
    tl.store(u_ptr + (base + r[:, None]) * BLOCK_DV + dv[None, :], u)
    tl.store(attn_ptr + (base + r[:, None]) * C + r[None, :], attn)


@triton.jit
def chunk_scan_kernel(q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, attn_ptr, state_ptr, slot_ptr, starts_ptr, lens_ptr,
                      first_ptr, continues_ptr, out_ptr, scale, Dk, Dv, stride_qt, stride_qh, stride_kt, stride_kh,
                      stride_gt, stride_ss, stride_sh, stride_sk, HV: tl.constexpr, GROUP: tl.constexpr,
                      C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_V: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Grid [B * HV, cdiv(Dv, BLOCK_V)]: sequence b's chunks in order for value head h, state columns dv."""
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // GROUP
    r = tl.arange(0, C)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_live = dv < Dv
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot >= 0:
        tile = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
        live = (dk[:, None] < Dk) & v_live[None, :]
        s = tl.load(tile, mask=live, other=0.0)
        s = tl.where(tl.load(continues_ptr + b) != 0, s, 0.0)  # a fresh sequence: whatever the slot held, not read
        for c in range(tl.load(first_ptr + b), tl.load(first_ptr + b + 1)):
            t0 = tl.load(starts_ptr + c)
            n = tl.load(lens_ptr + c)
            rows_live = r < n
            k = _normalized(_load_rows(k_ptr + hk * stride_kh, t0, n, stride_kt, dk, Dk, C).to(tl.float32))
            q = _normalized(_load_rows(q_ptr + hk * stride_qh, t0, n, stride_qt, dk, Dk, C).to(tl.float32)) * scale
            g = tl.load(g_ptr + (t0 + r).to(tl.int64) * stride_gt + h, mask=rows_live, other=0.0)
            cum = tl.cumsum(g, axis=0)
            last = tl.sum(g, axis=0)
            base = (c * HV + h).to(tl.int64) * C
            w = tl.load(w_ptr + (base + r[:, None]) * BLOCK_K + dk[None, :])
            u = tl.load(u_ptr + (base + r[:, None]) * BLOCK_DV + dv[None, :], mask=v_live[None, :], other=0.0)
            attn = tl.load(attn_ptr + (base + r[:, None]) * C + r[None, :])
            v_new = u - tl.dot(w, s, input_precision=PRECISION)
            o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PRECISION) + tl.dot(attn, v_new,
                                                                                   input_precision=PRECISION)
            tl.store(out_ptr + ((t0 + r[:, None]).to(tl.int64) * HV + h) * Dv + dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=rows_live[:, None] & v_live[None, :])
            k_decayed = k * tl.exp(last - cum)[:, None]
            s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PRECISION)
        tl.store(tile, s, mask=live)
