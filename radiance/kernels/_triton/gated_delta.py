"""Gated DeltaNet decode step (Qwen3.5 / Qwen3-Next) in two launches: the depthwise causal conv of the new token
(`conv_update`) and the delta-rule state step (`recurrent_step`), each reading and updating the per-sequence
states in place at their slots. Same math as layers/gated_delta.py's causal_conv1d_varlen and
gated_delta_rule_varlen with every q_len 1 and every has_initial_state True (what vLLM / FLA call
causal_conv1d_update and fused_recurrent_gated_delta_rule). No host data (no .item(), no host lists): both launch
under CUDA graph capture. A slot < 0 is a padding row: nothing read or written at any slot, its output zeros.
Two rows naming one slot race (as in the torch reference, the last write wins there): the engine never does that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT16 = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_FLOAT16)


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                state_slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence through the depthwise causal conv + SiLU: x [B, C] (rows may be strided, channels
    contiguous), weight [C, K] float32 or 16-bit (conv1d.weight[:, 0]), conv_state [S, C, K-1] (any strides; the
    K-1 previous inputs, oldest first) UPDATED IN PLACE at state_slots [B] (int32/int64, < 0: padding) to the last
    K-1 inputs. Returns [B, C] in x's dtype = silu(sum_j weight[:, j] * [old inputs; x][:, j]), in float32
    (the old inputs rounded to x's dtype first, as the reference concatenates them with x)."""
    B, C, K = check_conv_inputs("conv_update", x, weight, conv_state)
    if state_slots.shape != (B,) or state_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"conv_update: state_slots must be int32/int64 [{B}], got {state_slots.dtype} "
                         f"{tuple(state_slots.shape)}")
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    # at least one channel per thread (32 a warp): no thread holds a copy of another's channel, whose state
    # entries it could read after that one shifted them
    block_c = max(32, min(_next_pow2(C), 256))
    grid = (B, triton.cdiv(C, block_c))
    conv_update_kernel[grid](x, weight, conv_state, state_slots, out, C, x.stride(0), weight.stride(0),
                             weight.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
                             K=K, BLOCK_C=block_c, num_warps=max(1, min(4, block_c // 64)))
    return out


def check_conv_inputs(what: str, x, weight, conv_state) -> tuple[int, int, int]:
    """(rows, C, K) of a conv launch's x [rows, C], weight [C, K] and conv_state [S, C, K-1], or the ValueError
    naming `what`: shapes that do not fit, K < 2, dtypes, x's channels not contiguous."""
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(f"{what} expects x [rows, C], weight [C, K], conv_state [S, C, K-1]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_state.shape)}")
    rows, C = x.shape
    K = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape[1:] != (C, K - 1) or K < 2:
        raise ValueError(f"{what}: weight {tuple(weight.shape)} / conv_state {tuple(conv_state.shape)} "
                         f"do not fit x {tuple(x.shape)} (kernel K >= 2)")
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS or conv_state.dtype not in _FLOATS:
        raise ValueError(f"{what}: float32/16-bit tensors only, got x {x.dtype}, weight {weight.dtype}, "
                         f"conv_state {conv_state.dtype}")
    if x.stride(1) != 1:  # coalesced channel loads; a copy would be fine for x but never for the state
        raise ValueError(f"{what}: x's channels must be contiguous")
    return rows, C, K


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, state_slots: torch.Tensor, scale: float | None = None,
                   block_v: int | None = None) -> torch.Tensor:
    """One token per sequence of the gated delta rule: q, k [B, Hk, Dk], v [B, Hv, Dv] (Hv a multiple of Hk; v head
    h reads q/k head h // (Hv // Hk); rows and heads may be strided, the last dim contiguous: views of the conv's
    output), g [B, Hv] float32 log decay, beta [B, Hv] any float dtype, state [S, Hv, Dk, Dv] float32 UPDATED IN
    PLACE at state_slots [B] (< 0: padding). q, k l2-normalized in fp32 (eps 1e-6 inside the root), q times scale
    (default Dk**-0.5); S = exp(g) S; S += k ((v - S^T k) beta)^T; out = S^T q. Returns [B, Hv, Dv] in v's dtype.
    One program per (row, value head, block_v columns of the state): the [Dk, block_v] state tile stays in
    registers from load to store (default block_v min(Dv, 32): a 128 x 32 fp32 tile is 32 registers a thread
    over 4 warps)."""
    check_delta_rule_inputs("recurrent_step", q, k, v, g, beta, state, state_slots)
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if state_slots.shape != (B,):
        raise ValueError(f"recurrent_step: one state slot per row: state_slots must be [{B}], got "
                         f"{tuple(state_slots.shape)}")
    block_k = _next_pow2(Dk)
    block_v = block_v or min(_next_pow2(Dv), 32)
    if block_k > 256 or block_v & (block_v - 1):
        raise ValueError(f"recurrent_step: Dk up to 256 (got {Dk}), block_v a power of two (got {block_v})")
    out = torch.empty((B, Hv, Dv), dtype=v.dtype, device=v.device)
    if B == 0:
        return out
    scale = Dk ** -0.5 if scale is None else float(scale)
    grid = (B * Hv, triton.cdiv(Dv, block_v))
    recurrent_step_kernel[grid](q, k, v, g, beta, state, state_slots, out, scale, Dk, Dv,
                                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                g.stride(0), beta.stride(0), state.stride(0), state.stride(1), state.stride(2),
                                HV=Hv, GROUP=Hv // Hk, BLOCK_K=block_k, BLOCK_V=block_v,
                                num_warps=max(1, min(4, block_k * block_v // 1024)))
    return out


def check_delta_rule_inputs(what: str, q, k, v, g, beta, state, state_slots) -> None:
    """What every delta-rule launch refuses (`what` names it): q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv],
    state [S, Hv, Dk, Dv] and state_slots [B] that do not fit together, dtypes, last dims that are not contiguous."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or state.dim() != 4 or state_slots.dim() != 1:
        raise ValueError(f"{what} expects q, k [T, Hk, Dk], v [T, Hv, Dv], state [S, Hv, Dk, Dv], state_slots [B]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(state.shape)}, "
                         f"{tuple(state_slots.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if v.shape[0] != T or Hv % Hk or state.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"{what}: v {tuple(v.shape)} / state {tuple(state.shape)} do not fit q {tuple(q.shape)} "
                         "(Hv a multiple of Hk)")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"{what}: g, beta must be [{T}, {Hv}], got {tuple(g.shape)}, {tuple(beta.shape)}")
    if g.dtype != torch.float32 or state.dtype != torch.float32 or beta.dtype not in _FLOATS:
        raise ValueError(f"{what}: g and state float32, beta a float dtype; got {g.dtype}, {state.dtype}, "
                         f"{beta.dtype}")
    if q.dtype not in _FLOATS or k.dtype not in _FLOATS or v.dtype not in _FLOATS:
        raise ValueError(f"{what}: q, k, v float32 or 16-bit, got {q.dtype}, {k.dtype}, {v.dtype}")
    if state_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: state_slots must be int32/int64, got {state_slots.dtype}")
    if (q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or g.stride(1) != 1 or beta.stride(1) != 1
            or state.stride(3) != 1):
        # the state is written in place, so it is never copied: its rows must already be contiguous
        raise ValueError(f"{what}: the last dim of q, k, v, g, beta and state must be contiguous")


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's per-head gates of a step in one launch: a, b [B, Hv] (the in_proj_a / in_proj_b outputs,
    rows may be strided), a_log, dt_bias [Hv] float32 -> (g = -exp(a_log) * softplus(a + dt_bias), beta =
    sigmoid(b)), both float32 [B, Hv]; softplus as torch's (x itself above 20). Was six torch launches a layer."""
    if a.dim() != 2 or b.shape != a.shape or a_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(f"decay_and_beta expects a, b [B, Hv] and a_log, dt_bias [Hv]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1 or not a_log.is_contiguous() or not dt_bias.is_contiguous():
        raise ValueError("decay_and_beta: the heads of a, b, a_log and dt_bias must be contiguous")
    B, H = a.shape
    g = torch.empty((B, H), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if B:
        block = _next_pow2(H)
        decay_beta_kernel[(B,)](a, b, a_log, dt_bias, g, beta, H, a.stride(0), b.stride(0), BLOCK=block,
                                num_warps=max(1, min(4, block // 128)))
    return g, beta


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.gated_delta.gated_rms_norm in one launch: rows x [N, D] (contiguous), gate [N, D] or [B, H, D] (N = B *
    H: a view of the input projection's z, rows and heads may be strided, D contiguous), weight [D] -> x
    RMS-normalized in float32, rounded to x's dtype, times weight (rounded again: transformers' `weight *
    normed.to(dtype)`), times silu(gate) in float32, in x's dtype. Was about eight torch launches a layer."""
    heads = gate.reshape(-1, 1, gate.shape[-1]) if gate.dim() == 2 else gate
    if (x.dim() != 2 or heads.dim() != 3 or heads.shape[0] * heads.shape[1] != x.shape[0]
            or heads.shape[2] != x.shape[1] or weight.shape != (x.shape[1],)):
        raise ValueError(f"gated_rms_norm expects x [N, D], gate [N, D] or [B, H, D] with B * H = N, and weight "
                         f"[D]; got {tuple(x.shape)}, {tuple(gate.shape)}, {tuple(weight.shape)}")
    if not (x.is_contiguous() and heads.stride(2) == 1 and weight.is_contiguous()):
        raise ValueError("gated_rms_norm: x and weight must be contiguous, and the gate's last dim")
    N, D = x.shape
    out = torch.empty_like(x)
    if N:
        block = _next_pow2(D)
        gated_rms_norm_kernel[(N,)](x, heads, weight, out, D, heads.shape[1], heads.stride(0), heads.stride(1),
                                    float(eps), BLOCK=block, num_warps=max(1, min(4, block // 128)))
    return out


@triton.jit
def decay_beta_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, H, stride_a, stride_b,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    live = h < H
    x = tl.load(a_ptr + row * stride_a + h, mask=live, other=0.0).to(tl.float32) \
        + tl.load(dt_bias_ptr + h, mask=live, other=0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + h, mask=live, other=0.0)) * softplus
    b = tl.load(b_ptr + row * stride_b + h, mask=live, other=0.0).to(tl.float32)
    tl.store(g_ptr + row * H + h, g, mask=live)
    tl.store(beta_ptr + row * H + h, tl.sigmoid(b), mask=live)


@triton.jit
def gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, D, H, stride_gb, stride_gh, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (batch row, head) = divmod(row, H)
    d = tl.arange(0, BLOCK)
    live = d < D
    x = tl.load(x_ptr + row * D + d, mask=live, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)).to(x.dtype)
    w = tl.load(w_ptr + d, mask=live, other=0.0)
    scaled = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)  # the weight product, rounded as torch rounds it
    z = tl.load(gate_ptr + (row // H) * stride_gb + (row % H) * stride_gh + d, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + d, (scaled.to(tl.float32) * z * tl.sigmoid(z)).to(out_ptr.dtype.element_ty),
             mask=live)


@triton.jit
def conv_update_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, out_ptr, C, stride_xb, stride_wc, stride_wk,
                       stride_ss, stride_sc, stride_sk, K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid [B, cdiv(C, BLOCK_C)]: BLOCK_C channels of one row; the K-1 old inputs are read tap by tap (a static
    loop), so shifting the window is a renaming of registers."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(out_ptr + b * C + c, tl.zeros((BLOCK_C,), dtype=out_ptr.dtype.element_ty), mask=live)
    else:
        x = tl.load(x_ptr + b * stride_xb + c, mask=live, other=0.0)
        row = state_ptr + slot * stride_ss + c * stride_sc
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(K - 1):
            old = tl.load(row + j * stride_sk, mask=live, other=0.0).to(x.dtype)
            acc += tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=live, other=0.0).to(tl.float32) \
                * old.to(tl.float32)
            if j > 0:  # the window moves one tap: old input j becomes state entry j - 1
                tl.store(row + (j - 1) * stride_sk, old.to(state_ptr.dtype.element_ty), mask=live)
        acc += tl.load(w_ptr + c * stride_wc + (K - 1) * stride_wk, mask=live, other=0.0).to(tl.float32) \
            * x.to(tl.float32)
        tl.store(row + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=live)
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + b * C + c, out.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, out_ptr, scale, Dk, Dv,
                          stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
                          stride_ss, stride_sh, stride_sk, HV: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid [B * HV, cdiv(Dv, BLOCK_V)]: the state tile [BLOCK_K, BLOCK_V] (rows: key dims, columns: value dims)
    of value head h of row b. q and k (a whole head, BLOCK_K wide) are normalized by every program of the head:
    a few hundred flops against a 16 KiB state tile."""
    bh = tl.program_id(0)
    b = (bh // HV).to(tl.int64)
    h = bh % HV
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_live = dk < Dk
    v_live = dv < Dv
    out_row = out_ptr + (b * HV + h) * Dv + dv
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(out_row, tl.zeros((BLOCK_V,), dtype=out_ptr.dtype.element_ty), mask=v_live)
    else:
        hk = h // GROUP
        q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + dk, mask=k_live, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + dk, mask=k_live, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv, mask=v_live, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + b * stride_gb + h))
        beta = tl.load(beta_ptr + b * stride_bb + h).to(tl.float32)
        tile = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
        live = k_live[:, None] & v_live[None, :]
        s = tl.load(tile, mask=live, other=0.0) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # what the decayed state mispredicts for k
        s = s + k[:, None] * delta[None, :]
        tl.store(tile, s, mask=live)
        tl.store(out_row, tl.sum(s * q[:, None], axis=0).to(out_ptr.dtype.element_ty), mask=v_live)
