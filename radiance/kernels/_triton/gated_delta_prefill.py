"""Gated DeltaNet prefill (Qwen3.5 / Qwen3-Next): the delta rule over each sequence's new tokens in one launch, token
by token, the state kept in registers from the first token to the last (FLA's fused_recurrent form of
layers/gated_delta.py's gated_delta_rule_varlen). The torch reference runs the chunked form as a Python loop of
small launches per 64-token chunk and per layer: host-bound, the GPU idle half of a Qwen3.5 prefill.

One program per (sequence, value head, block_v columns of the state): a [Dk, block_v] float32 tile (one warp, 32
registers a thread for 128 x 8) starts from the sequence's slot (or zeros: its first tokens), takes each token in
order and goes back to the slot at the end. Sequences of any lengths share the launch (cu_seqlens). Each token is a
chain of dependent loads and reductions: ~1.1 us a token a layer at Qwen3.5-9B's heads on an H100 whatever the
tiling (tools/gated_delta_prefill_sweep.py; 128 x 32 tiles over 4 warps took 1.5-2.0 us), not tensor-core
throughput (the chunked form's; not written yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.gated_delta import _next_pow2, check_delta_rule_inputs


def recurrent_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                      continues: torch.Tensor, scale: float | None = None, block_v: int | None = None,
                      num_warps: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The delta rule over sequences back to back: q, k [T, Hk, Dk], v [T, Hv, Dv] (Hv a multiple of Hk; rows and
    heads may be strided, the last dim contiguous: views of the conv's output), g [T, Hv] float32 log decay, beta
    [T, Hv], state [S, Hv, Dk, Dv] float32 UPDATED IN PLACE at state_slots [B] (< 0: nothing read or written),
    cu_seqlens [B + 1] (sequence i's rows cu_seqlens[i]:cu_seqlens[i + 1]), continues [B] (0: the sequence starts
    here, its slot's old contents are not read). q, k l2-normalized in fp32 (eps 1e-6 inside the root), q times scale
    (default Dk**-0.5). Returns [T, Hv, Dv] in v's dtype (`out` if given: a contiguous one, e.g. a CUDA graph's
    static buffer; rows past cu_seqlens[B] left as they were). block_v / num_warps: the tiling (defaults min(Dv, 8)
    and one warp, the sweep's best)."""
    _check_prefill_inputs("recurrent_prefill", q, k, v, g, beta, state, state_slots, continues)
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    if cu_seqlens.shape != (B + 1,):
        raise ValueError(f"recurrent_prefill: cu_seqlens must be [{B + 1}], got {tuple(cu_seqlens.shape)}")
    block_k = _next_pow2(Dk)
    block_v = block_v or min(_next_pow2(Dv), 8)
    if block_k > 256 or block_v & (block_v - 1):
        raise ValueError(f"recurrent_prefill: Dk up to 256 (got {Dk}), block_v a power of two (got {block_v})")
    out = output_buffer("recurrent_prefill", out, (T, Hv, Dv), v)
    if B == 0 or T == 0:
        return out
    scale = Dk ** -0.5 if scale is None else float(scale)
    continues = continues if continues.dtype == torch.int32 else continues.to(torch.int32)
    grid = (B * Hv, triton.cdiv(Dv, block_v))
    recurrent_prefill_kernel[grid](q, k, v, g, beta, state, state_slots, cu_seqlens, continues, out, scale, Dk, Dv,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   g.stride(0), beta.stride(0), state.stride(0), state.stride(1), state.stride(2),
                                   HV=Hv, GROUP=Hv // Hk, BLOCK_K=block_k, BLOCK_V=block_v,
                                   num_warps=num_warps or 1)
    return out


def output_buffer(what: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A kernel's output: a new tensor, or the caller's `out` once its shape, dtype and layout are checked."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous {like.dtype} {shape} on {like.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return out


def _check_prefill_inputs(what: str, q, k, v, g, beta, state, state_slots, continues) -> None:
    """check_delta_rule_inputs, and one `continues` flag per sequence."""
    check_delta_rule_inputs(what, q, k, v, g, beta, state, state_slots)
    if continues.shape != state_slots.shape:
        raise ValueError(f"{what}: continues must be like state_slots {tuple(state_slots.shape)}, got "
                         f"{tuple(continues.shape)}")


@triton.jit
def recurrent_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, cu_ptr, continues_ptr, out_ptr,
                             scale, Dk, Dv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_gt, stride_bt, stride_ss, stride_sh, stride_sk, HV: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid [B * HV, cdiv(Dv, BLOCK_V)]: value head h of sequence b, state columns dv, every token of the sequence."""
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // GROUP
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_live = dk < Dk
    v_live = dv < Dv
    live = k_live[:, None] & v_live[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    if slot >= 0:
        tile = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
        s = tl.load(tile, mask=live, other=0.0)
        s = tl.where(tl.load(continues_ptr + b) != 0, s, 0.0)  # a fresh sequence: whatever the slot held, not read
        for t in range(start, end):
            q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + dk, mask=k_live, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + dk, mask=k_live, other=0.0).to(tl.float32)
            q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=v_live, other=0.0).to(tl.float32)
            s = s * tl.exp(tl.load(g_ptr + t * stride_gt + h))
            beta = tl.load(beta_ptr + t * stride_bt + h).to(tl.float32)
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # what the decayed state mispredicts for k
            s = s + k[:, None] * delta[None, :]
            tl.store(out_ptr + (t * HV + h) * Dv + dv, tl.sum(s * q[:, None], axis=0).to(out_ptr.dtype.element_ty),
                     mask=v_live)
        tl.store(tile, s, mask=live)

