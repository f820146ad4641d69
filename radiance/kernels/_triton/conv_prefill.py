"""Gated DeltaNet prefill conv (Qwen3.5 / Qwen3-Next): the depthwise causal conv + SiLU over sequences back to back
(cu_seqlens), layers/gated_delta.py's causal_conv1d_varlen without host lists (what vLLM / FLA call causal_conv1d_fn
with a varlen batch). Each sequence reads as [its slot's K-1 old inputs (zeros when it starts here); its rows].

Two launches: the outputs (a program per sequence, BLOCK_T rows and BLOCK_C channels), then the slots' new tails (a
program per sequence and BLOCK_C channels). The first reads the old state wherever a row's window reaches back before
the sequence, in programs the second launch's writes would race with; a launch boundary orders them for free. The
second loads its whole new tail before storing any of it (a short sequence's tail holds old entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.gated_delta import _next_pow2, check_conv_inputs

_INTS = (torch.int32, torch.int64)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
                          cu_seqlens: torch.Tensor, continues: torch.Tensor, max_q_len: int) -> torch.Tensor:
    """x [T, C] (sequence i's rows cu_seqlens[i]:cu_seqlens[i + 1]; rows may be strided, channels contiguous),
    weight [C, K] float32 or 16-bit (conv1d.weight[:, 0]), conv_state [S, C, K-1] (any strides; the K-1 previous
    inputs, oldest first) UPDATED IN PLACE at state_slots [B] (int32/int64, < 0: a padding sequence, nothing read or
    written, its rows zeros) to each sequence's last K-1 inputs (old ones among them when q_len < K-1), continues [B]
    (0: the sequence starts here, its slot's old contents read as zeros), max_q_len: a host bound on every q_len (the
    grid). Returns [T, C] in x's dtype = silu(causal conv) in float32, the old inputs rounded to x's dtype first (as
    the reference concatenates them with x). Rows past cu_seqlens[B] are left unwritten."""
    T, C, K = check_conv_inputs("causal_conv1d_prefill", x, weight, conv_state)
    if state_slots.dim() != 1 or state_slots.dtype not in _INTS:
        raise ValueError(f"causal_conv1d_prefill: state_slots must be int32/int64 [B], got {state_slots.dtype} "
                         f"{tuple(state_slots.shape)}")
    B = state_slots.shape[0]
    if cu_seqlens.shape != (B + 1,) or cu_seqlens.dtype not in _INTS:
        raise ValueError(f"causal_conv1d_prefill: cu_seqlens must be int32/int64 [{B + 1}], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if continues.shape != (B,) or continues.dtype not in _INTS:
        raise ValueError(f"causal_conv1d_prefill: continues must be int32/int64 [{B}], got {continues.dtype} "
                         f"{tuple(continues.shape)}")
    if int(max_q_len) < 0:
        raise ValueError(f"causal_conv1d_prefill: max_q_len must be >= 0, got {max_q_len}")
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    strides = (weight.stride(0), weight.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2))
    if T and max_q_len:
        # short prompts (a few tokens a sequence) need not pay for 64 masked rows a program
        block_t = min(64, max(8, _next_pow2(max_q_len)))
        block_c = max(32, min(_next_pow2(C), 128))
        grid = (B, triton.cdiv(max_q_len, block_t), triton.cdiv(C, block_c))
        conv_prefill_kernel[grid](x, weight, conv_state, state_slots, cu_seqlens, continues, out, C, x.stride(0),
                                  *strides, K=K, BLOCK_T=block_t, BLOCK_C=block_c,
                                  num_warps=max(1, min(8, block_t * block_c // 1024)))
    block_c = max(32, min(_next_pow2(C), 256))
    conv_prefill_state_kernel[(B, triton.cdiv(C, block_c))](
        x, conv_state, state_slots, cu_seqlens, continues, C, x.stride(0), *strides[2:], K=K,
        BLOCK_K=_next_pow2(K - 1), BLOCK_C=block_c, num_warps=max(1, min(4, block_c // 64)))
    return out


@triton.jit
def conv_prefill_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, cu_ptr, continues_ptr, out_ptr, C, stride_xt, stride_wc,
                        stride_wk, stride_ss, stride_sc, stride_sk, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Grid [B, cdiv(max_q_len, BLOCK_T), cdiv(C, BLOCK_C)]: rows p of sequence b, channels c. Tap j of row p reads
    position p + j - (K-1): a row of x when >= 0, else the old state's entry (K-1) + that (zeros when fresh)."""
    b = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(cu_ptr + b).to(tl.int64)
    q_len = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
    if tl.program_id(1) * BLOCK_T < q_len:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        c_live = c < C
        live = (p < q_len)[:, None] & c_live[None, :]
        out = out_ptr + (start + p)[:, None] * C + c[None, :]
        if slot < 0:
            tl.store(out, tl.zeros((BLOCK_T, BLOCK_C), dtype=out_ptr.dtype.element_ty), mask=live)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
            if (tl.program_id(1) * BLOCK_T < K - 1) & (tl.load(continues_ptr + b) != 0):
                # rows r < K-1 start from their old-state taps j < K-1-r (old entry r + j), summed first as those
                # taps come first; read here, by the programs holding those rows only, as [BLOCK_C] vectors
                for r in tl.static_range(K - 1):
                    head = tl.zeros((BLOCK_C,), dtype=tl.float32)
                    for j in tl.static_range(K - 1 - r):
                        old = tl.load(state_ptr + slot * stride_ss + c * stride_sc + (r + j) * stride_sk, mask=c_live,
                                      other=0.0)
                        w = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_live, other=0.0).to(tl.float32)
                        head += w * old.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference's cat
                    acc = tl.where((p == r)[:, None], head[None, :], acc)
            rows = x_ptr + (start + p)[:, None] * stride_xt + c[None, :]
            for j in tl.static_range(K):
                shift = j - (K - 1)  # rows before the sequence's first are masked, never read
                xv = tl.load(rows + shift * stride_xt, mask=live & (p + shift >= 0)[:, None], other=0.0)
                w = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_live, other=0.0).to(tl.float32)
                acc += xv.to(tl.float32) * w[None, :]
            tl.store(out, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def conv_prefill_state_kernel(x_ptr, state_ptr, slot_ptr, cu_ptr, continues_ptr, C, stride_xt, stride_ss, stride_sc,
                              stride_sk, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid [B, cdiv(C, BLOCK_C)]: the new tail of sequence b's slot, entry i = extended position q_len + i, i.e.
    row q_len + i - (K-1) of x, or the old entry q_len + i when that row is < 0 (zeros when fresh)."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)  # BLOCK_K >= K-1 entries
    live = (i < K - 1)[:, None] & (c < C)[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot >= 0:
        start = tl.load(cu_ptr + b).to(tl.int64)
        q_len = (tl.load(cu_ptr + b + 1) - start).to(tl.int32)
        lowest = tl.where(tl.load(continues_ptr + b) != 0, 1 - K, 0)
        row = state_ptr + slot * stride_ss + c[None, :] * stride_sc
        src = (q_len + i - (K - 1))[:, None]
        xv = tl.load(x_ptr + (start + tl.maximum(src, 0)) * stride_xt + c[None, :], mask=live & (src >= 0), other=0.0)
        old = tl.load(row + tl.minimum(src + (K - 1), K - 2) * stride_sk, mask=live & (src < 0) & (src >= lowest),
                      other=0.0)
        tail = tl.where(src >= 0, xv, old.to(xv.dtype))  # rounded to x's dtype, as the reference's cat
        # entry i may come from old entry q_len + i, which another thread of the program may hold: every load of
        # the program before any store
        tl.debug_barrier()
        tl.store(row + i[:, None] * stride_sk, tail.to(state_ptr.dtype.element_ty), mask=live)
