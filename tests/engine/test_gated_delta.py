"""The Gated DeltaNet reference ops over a flattened varlen step (radiance.layers.gated_delta) against HF's own
Qwen3.5 functions run one sequence at a time: the causal conv with its carried tail, the chunked and recurrent
delta rule with its carried state, and the gated RMSNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radiance.layers.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen, gated_rms_norm

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

S = 8  # state slots


def _slots(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(S, generator=torch.Generator().manual_seed(seed))[:n]


def _split(t: torch.Tensor, q_lens):
    return torch.split(t, list(q_lens))


# ---- causal conv -------------------------------------------------------------------------------------------------

def _hf_conv(x_seq, weight, old):
    """HF on one sequence [L, C], old tail [C, K-1] or None: (out [L, C], new tail [C, K-1])."""
    K, L = weight.shape[1], x_seq.shape[0]
    xt = x_seq.T[None]
    if old is None:
        out = hf.causal_conv1d_fn(xt, weight, activation="silu")
    elif L == 1:  # the decode step, as HF's cache runs it
        tail = old.clone()[None]
        out = hf.causal_conv1d_update(xt, tail, weight, activation="silu")
    else:  # a continued chunk: the old tail, then the new rows, through the prefill function
        out = hf.causal_conv1d_fn(torch.cat([old[None], xt], -1), weight, activation="silu")[..., -L:]
    full = torch.cat([x_seq.new_zeros(x_seq.shape[1], K - 1) if old is None else old, x_seq.T], -1)
    return out[0].T, full[:, -(K - 1):]


@pytest.mark.parametrize("q_lens", [[1, 5, 17], [3], [1, 1, 1, 1], [2, 1, 6, 1]])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_conv_matches_hf_per_sequence_and_carries_the_tail(q_lens, x_dtype, w_dtype):
    torch.manual_seed(len(q_lens))
    C, K = 24, 4
    x = torch.randn(sum(q_lens), C).to(x_dtype)
    weight = torch.randn(C, K).to(w_dtype)
    conv_state = torch.randn(S, C, K - 1).to(x_dtype)
    before = conv_state.clone()
    slots = _slots(len(q_lens), 1)
    has_init = [i % 2 == 0 for i in range(len(q_lens))]  # the first continues, then alternating
    out = causal_conv1d_varlen(x, weight, conv_state, slots, q_lens, has_init)
    assert out.dtype == x_dtype and out.shape == x.shape
    # HF computes in weight.dtype (a bf16 weight: conv and silu rounded to bf16), radiance in float32 rounded once;
    # with a float32 weight only the summation order differs, so at most one ulp of x's dtype
    tol = {(torch.float32, torch.float32): dict(atol=1e-6, rtol=1e-5),
           (torch.bfloat16, torch.float32): dict(atol=1e-3, rtol=8e-3),
           (torch.bfloat16, torch.bfloat16): dict(atol=1e-2, rtol=1.6e-2)}[x_dtype, w_dtype]
    for i, (xs, o) in enumerate(zip(_split(x, q_lens), _split(out, q_lens))):
        ref, tail = _hf_conv(xs, weight, before[slots[i]] if has_init[i] else None)
        torch.testing.assert_close(o.float(), ref.float(), **tol)
        assert torch.equal(conv_state[slots[i]], tail)  # the raw last K-1 inputs, bit for bit
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(conv_state[untouched], before[untouched])


@pytest.mark.parametrize("q_len", [1, 2])
def test_conv_tail_shorter_than_the_kernel_keeps_part_of_the_old_state(q_len):
    torch.manual_seed(0)
    C, K = 8, 4
    x, weight, conv_state = torch.randn(q_len, C), torch.randn(C, K), torch.randn(S, C, K - 1)
    old = conv_state[5].clone()
    causal_conv1d_varlen(x, weight, conv_state, torch.tensor([5]), [q_len], [True])
    assert torch.equal(conv_state[5, :, :K - 1 - q_len], old[:, q_len:])
    assert torch.equal(conv_state[5, :, K - 1 - q_len:], x.T)
    # a fresh sequence as short: zeros before its inputs, whatever the slot held (NaN included)
    conv_state[6] = float("nan")
    out = causal_conv1d_varlen(x, weight, conv_state, torch.tensor([6]), [q_len], [False])
    assert torch.equal(conv_state[6, :, :K - 1 - q_len], torch.zeros(C, K - 1 - q_len))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _hf_conv(x, weight, None)[0], atol=1e-6, rtol=1e-5)


def test_conv_split_prefill_equals_one_run():
    torch.manual_seed(3)
    C, K = 16, 4
    x, weight = torch.randn(23, C), torch.randn(C, K)
    one, two = torch.zeros(S, C, K - 1), torch.zeros(S, C, K - 1)
    whole = causal_conv1d_varlen(x, weight, one, torch.tensor([2]), [23], [False])
    a = causal_conv1d_varlen(x[:9], weight, two, torch.tensor([2]), [9], [False])
    b = causal_conv1d_varlen(x[9:], weight, two, torch.tensor([2]), [14], [True])
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-6, rtol=1e-5)
    assert torch.equal(one, two)


# ---- gated delta rule --------------------------------------------------------------------------------------------

def _delta_inputs(q_lens, hk, hv, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = sum(q_lens)
    q, k = torch.randn(T, hk, d, generator=g), torch.randn(T, hk, d, generator=g)
    v = torch.randn(T, hv, d, generator=g)
    decay = -F.softplus(torch.randn(T, hv, generator=g)) * 0.5  # log decays in about (-2, 0)
    beta = torch.sigmoid(torch.randn(T, hv, generator=g))
    state = torch.randn(S, hv, d, d, generator=g) * 0.3
    return q.to(dtype), k.to(dtype), v.to(dtype), decay, beta.to(dtype), state


def _hf_delta(q, k, v, g, beta, init, chunk_size=64):
    """HF on one sequence ([L, H, D] rows): the recurrent form for one token, the chunked one for more."""
    args = [t[None] for t in (q, k, v, g, beta)]
    kw = dict(initial_state=None if init is None else init[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    if q.shape[0] == 1:
        out, final = hf.torch_recurrent_gated_delta_rule(*args, **kw)
    else:
        out, final = hf.torch_chunk_gated_delta_rule(*args, chunk_size=chunk_size, **kw)
    return out[0], final[0]


@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("q_lens", [[1, 7, 64, 130], [130], [7, 1, 65], [1, 1, 1]])
@pytest.mark.parametrize("init", ["none", "all", "mixed"])
def test_delta_rule_matches_hf_per_sequence(hk, hv, d, q_lens, init):
    q, k, v, g, beta, state = _delta_inputs(q_lens, hk, hv, d, seed=d + len(q_lens))
    before = state.clone()
    slots = _slots(len(q_lens), 2)
    has_init = [init == "all" or (init == "mixed" and i % 2 == 1) for i in range(len(q_lens))]
    out = gated_delta_rule_varlen(q, k, v, g, beta, state, slots, q_lens, has_init)
    assert out.shape == v.shape and out.dtype == v.dtype
    for i, rows in enumerate(zip(*(_split(t, q_lens) for t in (q, k, v, g, beta, out)))):
        ref, final = _hf_delta(*rows[:5], before[slots[i]] if has_init[i] else None)
        torch.testing.assert_close(rows[5], ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state[slots[i]], final, atol=1e-5, rtol=1e-4)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(state[untouched], before[untouched])


def test_delta_rule_chunk_size_is_honoured():
    q_lens = [50, 33]
    q, k, v, g, beta, state = _delta_inputs(q_lens, 2, 4, 16, seed=7)
    before = state.clone()
    out = gated_delta_rule_varlen(q, k, v, g, beta, state, torch.tensor([0, 1]), q_lens, [True, False], chunk_size=16)
    for i, rows in enumerate(zip(*(_split(t, q_lens) for t in (q, k, v, g, beta, out)))):
        ref, final = _hf_delta(*rows[:5], before[i] if i == 0 else None, chunk_size=16)
        torch.testing.assert_close(rows[5], ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state[i], final, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("first", [40, 64, 1])
def test_delta_rule_split_prefill_equals_one_run(first):
    q, k, v, g, beta, state = _delta_inputs([70], 2, 4, 32, seed=11)
    one, two = state.clone(), state.clone()
    slot = torch.tensor([3])
    whole = gated_delta_rule_varlen(q, k, v, g, beta, one, slot, [70], [True])
    rows = (q, k, v, g, beta)
    a = gated_delta_rule_varlen(*(t[:first] for t in rows), two, slot, [first], [True])
    b = gated_delta_rule_varlen(*(t[first:] for t in rows), two, slot, [70 - first], [True])
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-4)


def test_decode_batch_equals_separate_recurrent_calls():
    q, k, v, g, beta, state = _delta_inputs([1] * 4, 2, 4, 16, seed=5)
    before = state.clone()
    state[6] = float("nan")  # a fresh sequence's slot may hold anything
    slots, has_init = torch.tensor([4, 0, 6, 2]), [True, True, False, True]
    out = gated_delta_rule_varlen(q, k, v, g, beta, state, slots, [1] * 4, has_init)
    for i in range(4):
        init = before[slots[i]][None] if has_init[i] else None
        ref, final = hf.torch_recurrent_gated_delta_rule(q[i:i + 1, None], k[i:i + 1, None], v[i:i + 1, None],
                                                         g[i:i + 1, None], beta[i:i + 1, None], initial_state=init,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[i], ref[0, 0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state[slots[i]], final[0], atol=1e-6, rtol=1e-5)


def test_bfloat16_inputs_run_close_to_float32_and_hf():
    q_lens = [1, 20, 70]
    q, k, v, g, beta, state = _delta_inputs(q_lens, 2, 4, 32, seed=13, dtype=torch.bfloat16)
    s16, s32 = state.clone(), state.clone()
    slots, has_init = torch.tensor([1, 2, 3]), [True, False, True]
    out = gated_delta_rule_varlen(q, k, v, g, beta, s16, slots, q_lens, has_init)
    assert out.dtype == torch.bfloat16 and s16.dtype == torch.float32
    ref = gated_delta_rule_varlen(q.float(), k.float(), v.float(), g, beta.float(), s32, slots, q_lens, has_init)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # only the output's rounding differs
    torch.testing.assert_close(s16, s32, atol=1e-6, rtol=1e-5)
    for i, rows in enumerate(zip(*(_split(t, q_lens) for t in (q, k, v, g, beta, out)))):
        hf_out, _ = _hf_delta(*rows[:5], state[slots[i]] if has_init[i] else None)
        assert hf_out.dtype == torch.bfloat16
        torch.testing.assert_close(rows[5].float(), hf_out.float(), atol=2e-2, rtol=2e-2)


# ---- gated RMSNorm -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_hf(dtype):
    torch.manual_seed(0)
    norm = hf.Qwen3_5RMSNormGated(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    norm = norm.to(dtype)
    x, gate = torch.randn(5, 3, 64).to(dtype) * 3, torch.randn(5, 3, 64).to(dtype)
    with torch.no_grad():
        ref = norm(x, gate)
    out = gated_rms_norm(x, gate, norm.weight.detach(), 1e-6)
    assert out.dtype == dtype
    assert torch.equal(out, ref)


@pytest.mark.parametrize("q_lens, keep", [([200], [(0, 3, 7)]), ([200], [(0, 1, 6)]),
                                          ([3, 130, 1, 70], [(1, 2, 6), (3, 1, 7)])])
def test_delta_rule_keeps_the_state_entering_a_chunk(q_lens, keep):
    """keep (sequence, chunk, row): the sequence's state after chunk x 64 of its tokens goes to `row` (a prefix
    cache's), as HF's run over those tokens alone leaves it; the slots still end where a run without keep does."""
    q, k, v, g, beta, state = _delta_inputs(q_lens, 2, 4, 16, seed=5)
    before, plain = state.clone(), state.clone()
    slots = torch.tensor([0, 1, 2, 3][:len(q_lens)])
    flags = [True] * len(q_lens)
    out = gated_delta_rule_varlen(q, k, v, g, beta, state, slots, q_lens, flags, keep=keep)
    assert torch.equal(out, gated_delta_rule_varlen(q, k, v, g, beta, plain, slots, q_lens, flags))
    assert torch.equal(state[slots], plain[slots])
    for seq, chunk, row in keep:
        rows = [t[:chunk * 64] for t in next(r for i, r in enumerate(zip(*(_split(t, q_lens) for t in
                                                                              (q, k, v, g, beta)))) if i == seq)]
        _, final = _hf_delta(*rows, before[slots[seq]])
        torch.testing.assert_close(state[row], final, atol=1e-5, rtol=1e-4)
