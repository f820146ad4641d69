"""The Gated DeltaNet prefill in the chunked form (layers/gated_delta._chunked on the GPU): each sequence cut into
CHUNK-token chunks, three launches.

1. Every (chunk, value head) at once: the chunk's decays, its delta-rule interactions A = strictly_lower(beta K
   K^T * decay), T = (I + A)^-1 (exact: forward substitution row by row, or four rows at a time within 16-row
   blocks joined by products, or doubling diagonal blocks: see chunked_prefill's `inverse`), W = T (K beta
   exp(cum)), U = T (V beta), K exp(cum_last - cum), exp(cum_last).
2. Every (sequence, value head, block_v state columns): the scan over the sequence's chunks with the state in
   registers, the only sequential part: each chunk's entering state S kept, V_new = U - W S kept, S = exp(cum_last)
   S + (K exp(cum_last - cum))^T V_new.
3. Every (chunk, value head, output_block_v columns) at once: O = (Q exp(cum)) S_entering + (Q K^T * decay) V_new.

Matrix products by default as three tf32 tensor-core products each (tf32x3, about fp32's accuracy), but the output
launch's in single tf32 for a 16-bit output (its terms feed no recurrence); ieee runs them in fp32 on the CUDA
cores. On an H100 at Qwen3.5-9B's heads the three launches took 0.40 us a token a layer at 8192 tokens and 0.50 at
1024 (seventy-first session), against the token-by-token kernel's 1.56 and 1.30
(gated_delta_prefill.recurrent_prefill); tools/gated_delta_prefill_sweep.py times both forms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.gated_delta import _next_pow2
from radiance.kernels._triton.gated_delta_prefill import _check_prefill_inputs, output_buffer


CHUNK = 64
# the longest sequence of a step from which the chunked form serves it: on an H100 at Qwen3.5-9B's heads it took 0.98
# us a token a layer at 256 tokens against the token-by-token kernel's 1.35 (0.54 against 1.54 at 8192)
CHUNKED_FROM = 256
# how the prepare launch inverts a chunk's (I + A): see chunked_prefill
INVERSES = ("blocks", "doubling", "refined", "rows")
PRECISIONS = ("ieee", "tf32x3", "tf32")  # tl.dot input_precision


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


def serving_chunks(q_lens: list[int], device: torch.device) -> DeltaChunks | None:
    """The chunk table of a prefill step the chunked form serves faster than the token-by-token kernel (its
    longest sequence at least CHUNKED_FROM tokens), else None."""
    return delta_chunks(q_lens, device) if max(q_lens, default=0) >= CHUNKED_FROM else None


def block_dims(Dk: int, Dv: int) -> tuple[int, int]:
    """The key and value head dims the launches compute in: powers of two, at least tl.dot's 16 (zeros pad)."""
    return max(16, _next_pow2(Dk)), max(16, _next_pow2(Dv))


def default_output_precision(precision: str, dtype: torch.dtype) -> str:
    """The output launch's products: single tf32 for a 16-bit output under tf32x3 (see chunked_prefill), else the
    prepare and scan launches' precision."""
    return "tf32" if precision == "tf32x3" and dtype in (torch.bfloat16, torch.float16) else precision


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, state_slots: torch.Tensor, chunks: DeltaChunks, continues: torch.Tensor,
                    scale: float | None = None, block_v: int = 32, precision: str = "tf32x3",
                    num_warps: int = 4, scan_warps: int = 8, inverse: str = "blocks", output_block_v: int = 64,
                    output_precision: str | None = None, output_warps: int | None = None,
                    scan_stages: int | None = None, keep: tuple[tuple[int, int], ...] = (),
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """recurrent_prefill's result in the chunked form (same arguments, the chunk table `chunks` in place of
    cu_seqlens: delta_chunks(q_lens)). Head dims below 16 (tl.dot's least) are padded with zeros. Scratch: (3 Dk +
    2 Dv) fp32 values a token and value head, and one Dk x Dv state a chunk and value head. precision: tl.dot's
    input_precision ("ieee": fp32 products on the CUDA cores; "tf32x3": three tf32 tensor-core products, about
    fp32's accuracy; "tf32"), num_warps: the prepare and output launches', scan_warps the scan's (on an H200 at
    Qwen3.5-9B's heads 8 warps scanned 8192 tokens in 0.80 ms against 0.90 at 4, where the prepare launch took twice
    as long at 8; tools/gated_delta_prefill_sweep.py times them),
    inverse: how launch 1 inverts (I + A) ("rows": forward substitution row by row, C - 1 steps; "blocks": four rows
    at a time within 16-row blocks, then the blocks joined by matrix products, 15 steps; "doubling": the inverses of
    the 2-, 4-, ... 64-row diagonal blocks in turn, 10 steps of two products; "refined": doubling in single tf32,
    then one Newton step at `precision`). block_v: the state columns a scan
    program carries, output_block_v an output program's (each recomputes the chunk's Q K^T: on an H200 at Qwen3.5-9B's
    heads 64 columns took the output launch from 1.32 to 0.85 ms at 8192 tokens, against 32; the scan keeps 32).
    output_precision and output_warps: the output launch's own (default num_warps, and precision but for a 16-bit
    output under tf32x3: single tf32 products, whose ~1e-3 relative error feeds no recurrence and sits at the output's
    own rounding: on an H100 at Qwen3.5-9B's heads the output launch 0.84 -> 0.35 ms at 8192 tokens, the largest
    difference from the recurrent form 2.3e-3 -> 4.6e-3 of the output's largest value, one bf16 step).
    scan_stages: the scan loop's software pipeline depth (Triton's num_stages; None: Triton's default), how many
    chunks' W, U and K loads are in flight ahead of the chunk being scanned (at 128 x 128 heads Triton 3.6's default of
    3 takes 176 KB of shared memory, and 4 stages more than an SM has: tools/delta_rule_resources.py).
    keep: (chunk, row) pairs: the state entering that chunk of the table (its sequence's state at the chunk's first
    token) copied into `state[row]` (a prefix cache's row). out: as recurrent_prefill's."""
    output_precision = output_precision or default_output_precision(precision, v.dtype)
    for name, given in (("precision", precision), ("output_precision", output_precision)):
        if given not in PRECISIONS:
            raise ValueError(f"chunked_prefill: {name} one of {', '.join(PRECISIONS)}, got {given!r}")
    if inverse not in INVERSES:
        raise ValueError(f"chunked_prefill: inverse one of {', '.join(INVERSES)}, got {inverse!r}")
    _check_prefill_inputs("chunked_prefill", q, k, v, g, beta, state, state_slots, continues)
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    if chunks.first_chunk.shape != (B + 1,):
        raise ValueError(f"chunked_prefill: a chunk table of {chunks.first_chunk.shape[0] - 1} sequences for {B}")
    block_k, block_dv = block_dims(Dk, Dv)
    if block_k > 256 or block_dv > 256 or block_v & (block_v - 1) or output_block_v & (output_block_v - 1):
        raise ValueError(f"chunked_prefill: Dk and Dv up to 256 (got {Dk}, {Dv}), block_v and output_block_v "
                         f"powers of two (got {block_v}, {output_block_v})")
    out = output_buffer("chunked_prefill", out, (T, Hv, Dv), v)
    if B == 0 or T == 0:
        return out
    scale = Dk ** -0.5 if scale is None else float(scale)
    continues = continues if continues.dtype == torch.int32 else continues.to(torch.int32)
    n, device = chunks.count, v.device
    w, k_decayed = (torch.empty((n, Hv, CHUNK, block_k), dtype=torch.float32, device=device) for _ in range(2))
    u, v_new = (torch.empty((n, Hv, CHUNK, block_dv), dtype=torch.float32, device=device) for _ in range(2))
    entering = torch.empty((n, Hv, block_k, block_dv), dtype=torch.float32, device=device)
    chunk_decay = torch.empty((n, Hv), dtype=torch.float32, device=device)
    common = dict(HV=Hv, GROUP=Hv // Hk, C=CHUNK, BLOCK_K=block_k, BLOCK_DV=block_dv, PRECISION=precision,
                  num_warps=num_warps)
    if n:
        chunk_prepare_kernel[(n, Hv)](k, v, g, beta, chunks.starts, chunks.lens, w, u, k_decayed, chunk_decay, Dk,
                                      Dv, k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
                                      beta.stride(0), INVERSE=inverse, **common)
    block_v = max(16, min(block_v, block_dv))
    chunk_scan_kernel[(B * Hv, triton.cdiv(Dv, block_v))](
        w, u, k_decayed, chunk_decay, v_new, entering, state, state_slots, chunks.first_chunk, continues, Dk, Dv,
        state.stride(0), state.stride(1), state.stride(2), BLOCK_V=block_v, **dict(common, num_warps=scan_warps),
        **({} if scan_stages is None else dict(num_stages=scan_stages)))
    if n:
        output_block_v = max(16, min(output_block_v, block_dv))
        chunk_output_kernel[(n, Hv, triton.cdiv(Dv, output_block_v))](
            q, k, g, v_new, entering, chunks.starts, chunks.lens, out, scale, Dk, Dv, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), g.stride(0), BLOCK_V=output_block_v,
            **dict(common, PRECISION=output_precision, num_warps=output_warps or num_warps))
    for chunk, row in keep:
        state[row].copy_(entering[chunk, :, :Dk, :Dv])
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
def _unit_lower_inverse_rows(a, r, C: tl.constexpr):
    """(I + A)^-1 for A [C, C] strictly lower: row i of T is e_i - sum_{j < i} A_ij T_j (rows j >= i are still
    e_j, and A_ij = 0 there)."""
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
        row = tl.where(r == i, 1.0, -tl.sum(a_i[:, None] * t, axis=0))
        t = tl.where(r[:, None] == i, row[None, :], t)
    return t


@triton.jit
def _unit_lower_inverse_blocks(a, r, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for A [C, C] strictly lower, C = 4 blocks of 16 rows: with D A's diagonal blocks and L the rest,
    I + A = (I + D)(I + M), M = (I + D)^-1 L strictly block-lower, so M^4 = 0 and (I + M)^-1 = (I - M)(I + M^2).
    (I + D)^-1 by forward substitution, the four blocks' row i at once (one product a step). Only products of
    16-row blocks, never powers of A: exact where the row-by-row substitution is (all-ones A included)."""
    tl.static_assert(C == 64, "four blocks of 16 rows: (I + M)^-1 = (I - M)(I + M^2) needs M^4 = 0")
    block = r // 16
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    same = block[:, None] == block[None, :]
    d = tl.where(same, a, 0.0)
    d_inv = eye
    for i in range(1, 16):
        rows = r % 16 == i
        found = tl.dot(tl.where(rows[:, None], d, 0.0), d_inv, input_precision=PRECISION)
        d_inv = tl.where(rows[:, None], eye - found, d_inv)
    m = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision=PRECISION)
    m2 = tl.dot(m, m, input_precision=PRECISION)
    return tl.dot(tl.dot(eye - m, eye + m2, input_precision=PRECISION), d_inv, input_precision=PRECISION)


@triton.jit
def _unit_lower_inverse_doubling(a, r, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for A [C, C] strictly lower by doubling diagonal blocks: with T the inverse of (I + A)'s diagonal
    blocks of s rows, those of 2s rows are [[T1, 0], [-T2 A21 T1, T2]] = T - T L T, L the lower-left s x s quadrant of
    each 2s block. The 1-row blocks are I, so the 2-row ones are I - L; then five levels of two products (10 against
    the "blocks" form's 19 dependent products), only products of inverse blocks, never powers of A."""
    tl.static_assert(C == 64, "six levels of doubling")
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    same_pair = r[:, None] // 2 == r[None, :] // 2
    t = eye - tl.where(same_pair & (r[:, None] > r[None, :]), a, 0.0)
    for level in tl.static_range(1, 6):
        half = 1 << level  # a compile-time int: level is static_range's
        quadrant = ((r[:, None] // (2 * half)) == (r[None, :] // (2 * half))) & ((r[:, None] // half) % 2 == 1) \
            & ((r[None, :] // half) % 2 == 0)
        t = t - tl.dot(t, tl.dot(tl.where(quadrant, a, 0.0), t, input_precision=PRECISION),
                       input_precision=PRECISION)
    return t


@triton.jit
def _unit_lower_inverse_refined(a, r, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 by doubling in single tf32 products (a third of tf32x3's tensor-core work), then one Newton step
    T + T E, E = I - (I + A) T: E's products at PRECISION, so the step squares tf32's relative error (~1e-3) away.
    T E is E-sized, so one tf32 product keeps it to PRECISION's accuracy too."""
    t = _unit_lower_inverse_doubling(a, r, C, "tf32")
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    residual = eye - t - tl.dot(a, t, input_precision=PRECISION)
    return t + tl.dot(t, residual, input_precision="tf32")


@triton.jit
def _chunk_decays(g_ptr, t0, n, h, stride_gt, C: tl.constexpr):
    """The chunk's cumulative log decays [C] (flat past its n rows) and the lower-triangular exp(cum_i - cum_j)."""
    r = tl.arange(0, C)
    g = tl.load(g_ptr + (t0 + r).to(tl.int64) * stride_gt + h, mask=r < n, other=0.0)
    cum = tl.cumsum(g, axis=0)
    lower = r[:, None] >= r[None, :]
    return cum, tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)


@triton.jit
def chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, starts_ptr, lens_ptr, w_ptr, u_ptr, kd_ptr, decay_ptr, Dk,
                         Dv, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, HV: tl.constexpr,
                         GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                         PRECISION: tl.constexpr, INVERSE: tl.constexpr):
    """Grid [chunks, HV], value head h in chunk c: W = T (K beta exp(cum)) [C, BLOCK_K], U = T (V beta) [C,
    BLOCK_DV], K exp(cum_last - cum) [C, BLOCK_K] and exp(cum_last), T = (I + A)^-1."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(starts_ptr + c)
    n = tl.load(lens_ptr + c)
    r = tl.arange(0, C)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_DV)
    k = _normalized(_load_rows(k_ptr + (h // GROUP) * stride_kh, t0, n, stride_kt, dk, Dk, C).to(tl.float32))
    v = _load_rows(v_ptr + h * stride_vh, t0, n, stride_vt, dv, Dv, C).to(tl.float32)
    beta = tl.load(beta_ptr + (t0 + r).to(tl.int64) * stride_bt + h, mask=r < n, other=0.0).to(tl.float32)
    cum, decay = _chunk_decays(g_ptr, t0, n, h, stride_gt, C)
    last = tl.sum(tl.where(r == C - 1, cum, 0.0), axis=0)  # cum is flat past the n rows: cum[n - 1]
    a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION) * decay
    a = tl.where(r[:, None] > r[None, :], a, 0.0)
    if INVERSE == "blocks":
        t = _unit_lower_inverse_blocks(a, r, C, PRECISION)
    elif INVERSE == "doubling":
        t = _unit_lower_inverse_doubling(a, r, C, PRECISION)
    elif INVERSE == "refined":
        t = _unit_lower_inverse_refined(a, r, C, PRECISION)
    else:
        t = _unit_lower_inverse_rows(a, r, C)
    w = tl.dot(t, k * (beta * tl.exp(cum))[:, None], input_precision=PRECISION)
    u = tl.dot(t, v * beta[:, None], input_precision=PRECISION)
    base = (c * HV + h).to(tl.int64) * C
    tl.store(w_ptr + (base + r[:, None]) * BLOCK_K + dk[None, :], w)
    tl.store(u_ptr + (base + r[:, None]) * BLOCK_DV + dv[None, :], u)
    tl.store(kd_ptr + (base + r[:, None]) * BLOCK_K + dk[None, :], k * tl.exp(last - cum)[:, None])
    tl.store(decay_ptr + c * HV + h, tl.exp(last))


@triton.jit
def chunk_scan_kernel(w_ptr, u_ptr, kd_ptr, decay_ptr, v_new_ptr, entering_ptr, state_ptr, slot_ptr, first_ptr,
                      continues_ptr, Dk, Dv, stride_ss, stride_sh, stride_sk, HV: tl.constexpr, GROUP: tl.constexpr,
                      C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_V: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Grid [B * HV, cdiv(Dv, BLOCK_V)]: sequence b's chunks in order for value head h, state columns dv, the only
    sequential part: each chunk's entering state kept for the output launch, V_new = U - W S, S = exp(cum_last) S +
    (K exp(cum_last - cum))^T V_new."""
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
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
            base = (c * HV + h).to(tl.int64)
            tl.store(entering_ptr + (base * BLOCK_K + dk[:, None]) * BLOCK_DV + dv[None, :], s,
                     mask=v_live[None, :])
            w = tl.load(w_ptr + (base * C + r[:, None]) * BLOCK_K + dk[None, :])
            u = tl.load(u_ptr + (base * C + r[:, None]) * BLOCK_DV + dv[None, :], mask=v_live[None, :], other=0.0)
            v_new = u - tl.dot(w, s, input_precision=PRECISION)
            tl.store(v_new_ptr + (base * C + r[:, None]) * BLOCK_DV + dv[None, :], v_new, mask=v_live[None, :])
            kd = tl.load(kd_ptr + (base * C + r[:, None]) * BLOCK_K + dk[None, :])
            s = s * tl.load(decay_ptr + base) + tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
        tl.store(tile, s, mask=live)


@triton.jit
def chunk_output_kernel(q_ptr, k_ptr, g_ptr, v_new_ptr, entering_ptr, starts_ptr, lens_ptr, out_ptr, scale, Dk, Dv,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, HV: tl.constexpr,
                        GROUP: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """Grid [chunks, HV, cdiv(Dv, BLOCK_V)], every chunk at once: O = (Q exp(cum)) S_entering + (Q K^T * decay)
    V_new, the chunk's own attention with its diagonal."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    t0 = tl.load(starts_ptr + c)
    n = tl.load(lens_ptr + c)
    r = tl.arange(0, C)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_live = dv < Dv
    k = _normalized(_load_rows(k_ptr + hk * stride_kh, t0, n, stride_kt, dk, Dk, C).to(tl.float32))
    q = _normalized(_load_rows(q_ptr + hk * stride_qh, t0, n, stride_qt, dk, Dk, C).to(tl.float32)) * scale
    cum, decay = _chunk_decays(g_ptr, t0, n, h, stride_gt, C)
    attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
    base = (c * HV + h).to(tl.int64)
    s = tl.load(entering_ptr + (base * BLOCK_K + dk[:, None]) * BLOCK_DV + dv[None, :], mask=v_live[None, :],
                other=0.0)
    v_new = tl.load(v_new_ptr + (base * C + r[:, None]) * BLOCK_DV + dv[None, :], mask=v_live[None, :], other=0.0)
    o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PRECISION) + tl.dot(attn, v_new,
                                                                           input_precision=PRECISION)
    tl.store(out_ptr + ((t0 + r[:, None]).to(tl.int64) * HV + h) * Dv + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(r[:, None] < n) & v_live[None, :])
