"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next), torch reference ops over a flattened varlen step.

Each head keeps a state S [Dk, Dv]; per token, with q, k l2-normalized (q also times Dk**-0.5):
    S <- exp(g) * S;   S <- S + beta * k (v - S^T k)^T;   o = S^T q
(a decayed delta rule: the old state's prediction S^T k is replaced by v at rate beta). A long sequence takes the
chunked (UT transform) form of HF's `torch_chunk_gated_delta_rule`, a one-token one the step above. Before it a
depthwise causal conv (kernel K) with SiLU runs over the q/k/v channels, carrying each sequence's last K-1 inputs.
Both states live in per-sequence slots (`state_slots`), updated in place, as a paged-KV engine keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radiance.layers.norm import rms_norm


def _offsets(q_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor(q_lens, dtype=torch.long, device=device)
    return lens, lens.cumsum(0) - lens


def _gather_states(state: torch.Tensor, state_slots: torch.Tensor, has_initial_state: list[bool]) -> torch.Tensor:
    """state[slots], zeros for sequences that start here (`where`, not a product: a fresh slot may hold NaNs)."""
    keep = torch.tensor(has_initial_state, dtype=torch.bool, device=state.device)
    old = state[state_slots]
    return torch.where(keep.view(-1, *[1] * (old.dim() - 1)), old, torch.zeros((), dtype=old.dtype, device=old.device))


def causal_conv1d_varlen(x, weight, conv_state, state_slots, q_lens, has_initial_state, activation="silu"):
    """x [T, C] (the step's rows, sequences back to back, q_lens[i] rows each, q_lens a host list of ints);
    weight [C, K] depthwise causal kernel; conv_state [S, C, K-1] per-slot tail of each sequence's previous
    inputs, UPDATED IN PLACE to the last K-1 inputs (zeros-padded when the sequence so far is shorter);
    state_slots [B] int64 tensor: the slot of each sequence; has_initial_state: list[bool] host (False: the
    sequence starts here, its old state is ignored/treated as zeros). Returns [T, C] = silu(conv) in x's dtype,
    computed in float32 (as the fused kernels do; HF computes in weight.dtype, the same when that is float32).

    No loop over sequences: each sequence reads as [its K-1 old inputs; its new rows] ("extended" positions),
    and every tap of every output is one row of buf = [all old inputs; x], found by index."""
    B, K = len(q_lens), weight.shape[1]
    lens, starts = _offsets(q_lens, x.device)
    old = _gather_states(conv_state, state_slots, has_initial_state)            # [B, C, K-1]
    buf = torch.cat([old.transpose(1, 2).reshape(B * (K - 1), -1).to(x.dtype), x])

    def rows(seq, ext):  # row of buf holding extended position `ext` of sequence `seq`
        return torch.where(ext < K - 1, seq * (K - 1) + ext, B * (K - 1) + starts[seq] + ext - (K - 1))

    seq = torch.repeat_interleave(torch.arange(B, device=x.device), lens)[:, None]   # [T, 1]
    pos = torch.arange(x.shape[0], device=x.device)[:, None] - starts[seq]           # position in its sequence
    taps = rows(seq, pos + torch.arange(K, device=x.device))                         # [T, K]: inputs of each output
    w = weight.float()
    out = sum(buf[taps[:, j]].float() * w[:, j] for j in range(K))
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    # the new tail: extended positions q_len .. q_len+K-2 (old inputs still among them when q_len < K-1)
    tail = rows(torch.arange(B, device=x.device)[:, None], lens[:, None] + torch.arange(K - 1, device=x.device))
    conv_state[state_slots] = buf[tail].transpose(1, 2).to(conv_state.dtype)
    return out.to(x.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)  # HF's / FLA's form (eps inside the root)


def _recurrent_step(q, k, v, g, beta, s):
    """One token of each of N sequences: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H], s [N, H, Dk, Dv]."""
    s = s * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]   # what the decayed state mispredicts for k
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def _chunked(q, k, v, g, beta, s, chunk_size, keep_chunk=None):
    """One sequence in HF's chunked form: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], s [H, Dk, Dv].
    Zero padding to whole chunks is inert (k = beta = 0 writes nothing, g = 0 decays nothing). Returns (outputs,
    final state, the state entering chunk `keep_chunk` or None)."""
    L, pad = q.shape[1], -q.shape[1] % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(1, (-1, chunk_size)) for t in (q, k, v))   # [H, N, C, D]
    g, beta = (F.pad(t, (0, pad)).unflatten(1, (-1, chunk_size)) for t in (g, beta))          # [H, N, C]
    cum = g.cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()   # i after j: exp(sum)
    k_beta = k * beta[..., None]
    # UT transform: (I + strictly_lower(beta K K^T * decay))^-1 folds the chunk's sequential delta updates
    ut = (k_beta @ k.mT) * decay
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.mT) * decay
    q_dec, k_dec = q * cum.exp()[..., None], k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out, kept = torch.empty_like(u), None
    for n in range(q.shape[1]):  # the scan over chunks, carrying the state
        if n == keep_chunk:
            kept = s
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = q_dec[:, n] @ s + attn[:, n] @ v_new
        s = s * chunk_decay[:, n] + k_dec[:, n].mT @ v_new
    return out.flatten(1, 2)[:, :L], s, kept


def gated_delta_rule_varlen(q, k, v, g, beta, state, state_slots, q_lens, has_initial_state, chunk_size=64,
                            keep=()):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] (each q/k head serves Hv//Hk consecutive v heads, HF's repeat_interleave);
    g [T, Hv] float32 log decay (<= 0); beta [T, Hv]; state [S, Hv, Dk, Dv] float32, UPDATED IN PLACE at each
    sequence's slot to its final state; state_slots [B] int64; q_lens, has_initial_state host lists as in
    causal_conv1d_varlen. q and k are l2-normalized here (fp32, eps 1e-6) and q scaled by Dk**-0.5 (HF's
    use_qk_l2norm_in_kernel=True). Returns [T, Hv, Dv] in v's dtype. One-token sequences take the recurrent step,
    all of them in one batch (a decode step: no loop over sequences); longer ones the chunked form, one by one.
    keep: (sequence, chunk, row) triples, one a sequence at most: the state entering that chunk of that sequence
    (its state after chunk x chunk_size tokens) copied into `state[row]` (a prefix cache's row)."""
    Hv, Dk = v.shape[1], q.shape[-1]
    q, k = (t.repeat_interleave(Hv // t.shape[1], dim=1).float() for t in (q, k))
    q, k = _l2norm(q) * Dk ** -0.5, _l2norm(k)
    vf, g, beta = v.float(), g.float(), beta.float()
    starts = _offsets(q_lens, v.device)[1]
    s = _gather_states(state, state_slots, has_initial_state).float()           # [B, Hv, Dk, Dv]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    single = [i for i, n in enumerate(q_lens) if n == 1]
    if single:
        single = torch.tensor(single, device=v.device)
        r = starts[single]
        out[r], s[single] = _recurrent_step(q[r], k[r], vf[r], g[r], beta[r], s[single])
    kept = {i: (chunk, row) for i, chunk, row in keep}
    start = 0
    for i, n in enumerate(q_lens):
        if n > 1:
            a = slice(start, start + n)
            chunk, row = kept.get(i, (None, None))
            o, s[i], entering = _chunked(*(t[a].transpose(0, 1) for t in (q, k, vf, g, beta)), s[i], chunk_size,
                                         chunk)
            out[a] = o.transpose(0, 1)
            if row is not None:
                state[row] = entering.to(state.dtype)
        start += n
    state[state_slots] = s.to(state.dtype)
    return out.to(v.dtype)


def gated_rms_norm(x, gate, weight, eps):
    """HF's Qwen3_5RMSNormGated: x [..., D] RMS-normalized in float32, rounded to x's dtype, times weight (HF's
    `weight * normed.to(input_dtype)`), times silu(gate) in float32; gate [..., D]. Returns x's dtype."""
    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
