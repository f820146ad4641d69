"""The Gated DeltaNet decode-step kernels (conv_update, recurrent_step) vs the torch reference ops of
layers/gated_delta.py at q_len 1 (run on CUDA, or on the CPU through the Triton interpreter by
test_triton_interpreter.py): outputs and the in-place updated state slots, slots out of order, padding rows,
states carried over several steps."""

import pytest
import torch
import torch.nn.functional as F

from radiance.kernels._triton.gated_delta import conv_update, decay_and_beta, gated_rms_norm, recurrent_step
from radiance.layers.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen
from radiance.layers.gated_delta import gated_rms_norm as gated_rms_norm_reference

SLOTS = 10
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):  # fp32: the kernel's sums run in another order; bf16: one rounding of the output
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _slots(batch, device, pad_row=None):
    """Distinct slots out of order ([5, 0, 2, ...]); pad_row's slot is -1."""
    order = [5, 0, 2, 9, 3, 7, 1, 8, 4, 6][:batch]
    if pad_row is not None:
        order[pad_row] = -1
    return torch.tensor(order, dtype=torch.int64, device=device)


def _ref_conv(x, weight, conv_state, slots):
    """causal_conv1d_varlen over the live rows (slot >= 0) at q_len 1, on a copy of the state; padding rows 0."""
    state = conv_state.clone()
    out = torch.zeros_like(x)
    live = (slots >= 0).nonzero().flatten()
    if len(live):
        out[live] = causal_conv1d_varlen(x[live], weight, state, slots[live], [1] * len(live), [True] * len(live))
    return out, state


def _ref_step(q, k, v, g, beta, state, slots):
    """gated_delta_rule_varlen over the live rows at q_len 1, on a copy of the state; padding rows 0."""
    state = state.clone()
    out = torch.zeros_like(v)
    live = (slots >= 0).nonzero().flatten()
    if len(live):
        out[live] = gated_delta_rule_varlen(q[live], k[live], v[live], g[live], beta[live], state, slots[live],
                                            [1] * len(live), [True] * len(live))
    return out, state


def _conv_inputs(batch, channels, kernel, dtype, w_dtype, device, gen):
    x = torch.randn(batch, channels, generator=gen).to(device, dtype)
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(device, w_dtype)
    conv_state = torch.randn(SLOTS, channels, kernel - 1, generator=gen).to(device, dtype)
    return x, weight, conv_state


def _step_inputs(batch, hk, hv, dk, dv, dtype, device, gen):
    q = (torch.randn(batch, hk, dk, generator=gen) * 2).to(device, dtype)
    k = (torch.randn(batch, hk, dk, generator=gen) * 2).to(device, dtype)
    v = torch.randn(batch, hv, dv, generator=gen).to(device, dtype)
    g = F.logsigmoid(torch.randn(batch, hv, generator=gen) + 2).to(device)  # log decay in (-inf, 0)
    beta = torch.sigmoid(torch.randn(batch, hv, generator=gen)).to(device, dtype)
    return q, k, v, g, beta


def _states(hv, dk, dv, device, gen):
    return (torch.randn(SLOTS, hv, dk, dv, generator=gen) * 0.3).to(device)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("channels,kernel", [(64, 4), (40, 4), (300, 3)])  # 40, 300: masked channel blocks
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_reference(device, batch, channels, kernel, dtype):
    gen = torch.Generator().manual_seed(batch * 100 + channels)
    w_dtype = torch.float32 if channels != 40 else dtype  # a 16-bit weight too
    x, weight, conv_state = _conv_inputs(batch, channels, kernel, dtype, w_dtype, device, gen)
    slots = _slots(batch, device)
    want, want_state = _ref_conv(x, weight, conv_state, slots)
    before = conv_state.clone()
    got = conv_update(x, weight, conv_state, slots)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(conv_state, want_state)  # the shift copies inputs: exact
    untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert torch.equal(conv_state[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_padding_row_and_strided_views(device, dtype):
    """A padding row (slot -1) reads and writes no slot and outputs zeros; x a strided view (the projection's
    q|k|v columns of a wider row), the weight conv1d.weight[:, 0], int32 slots."""
    gen = torch.Generator().manual_seed(3)
    channels, kernel = 96, 4
    wide = torch.randn(3, channels + 32, generator=gen).to(device, dtype)
    x = wide[:, 16:16 + channels]
    weight = torch.randn(channels, 1, kernel, generator=gen).to(device)[:, 0]
    conv_state = torch.randn(SLOTS, channels, kernel - 1, generator=gen).to(device, dtype)
    slots = _slots(3, device, pad_row=1).to(torch.int32)
    want, want_state = _ref_conv(x, weight, conv_state, slots.long())
    before = conv_state.clone()
    got = conv_update(x, weight, conv_state, slots)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(conv_state, want_state)
    changed = (conv_state != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]
    # all rows padding: nothing moves
    assert torch.equal(conv_update(x, weight, conv_state, torch.full_like(slots, -1)), torch.zeros_like(x))
    assert torch.equal(conv_state, want_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_carries_the_state_over_steps(device, dtype):
    gen = torch.Generator().manual_seed(4)
    channels, kernel, batch = 48, 4, 3
    _, weight, conv_state = _conv_inputs(batch, channels, kernel, dtype, torch.float32, device, gen)
    ref_state = conv_state.clone()
    slots = _slots(batch, device)
    for _ in range(5):  # more steps than the window: every old input has left it
        x = torch.randn(batch, channels, generator=gen).to(device, dtype)
        want, ref_state = _ref_conv(x, weight, ref_state, slots)
        torch.testing.assert_close(conv_update(x, weight, conv_state, slots), want, **_tol(dtype))
        assert torch.equal(conv_state, ref_state)


# B x (Hk, Hv) x (Dk, Dv), the whole product (about 20 s of the interpreter for both dtypes)
STEP_CASES = [pytest.param(b, heads, dims, id=f"B{b}-H{heads[0]}x{heads[1]}-D{dims[0]}x{dims[1]}")
              for b in (1, 3, 8) for heads in ((2, 2), (2, 4), (1, 4)) for dims in ((16, 16), (32, 64), (128, 128))]


@pytest.mark.parametrize("batch,heads,dims", STEP_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_step_matches_reference(device, batch, heads, dims, dtype):
    (hk, hv), (dk, dv) = heads, dims
    gen = torch.Generator().manual_seed(batch * 1000 + hv * 100 + dk)
    q, k, v, g, beta = _step_inputs(batch, hk, hv, dk, dv, dtype, device, gen)
    state = _states(hv, dk, dv, device, gen)
    slots = _slots(batch, device)
    want, want_state = _ref_step(q, k, v, g, beta, state, slots)
    before = state.clone()
    got = recurrent_step(q, k, v, g, beta, state, slots)
    assert got.dtype == dtype and got.shape == v.shape
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)  # fp32 from the same (rounded) inputs
    untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_step_padding_row_strided_views_and_odd_dims(device, dtype):
    """q, k, v as views of the conv's output row (q | k | v), non-power-of-two head dims, a padding row (zeros
    out, no slot touched), int32 slots, Dv split over several programs (block_v), a row whose q and k norms are
    near the l2 norm's eps."""
    gen = torch.Generator().manual_seed(5)
    batch, hk, hv, dk, dv = 4, 2, 6, 24, 40
    mixed = torch.randn(batch, 2 * hk * dk + hv * dv, generator=gen)
    mixed[0, :2 * hk * dk] *= 1e-3  # q and k norms near the eps of the l2 norm
    mixed = mixed.to(device, dtype)
    q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    q, k, v = q.reshape(batch, hk, dk), k.reshape(batch, hk, dk), v.reshape(batch, hv, dv)
    g = F.logsigmoid(torch.randn(batch, hv, generator=gen)).to(device)
    beta = torch.sigmoid(torch.randn(batch, 2 * hv, generator=gen)).to(device, dtype)[:, hv:]  # strided rows
    state = _states(hv, dk, dv, device, gen)
    slots = _slots(batch, device, pad_row=2).to(torch.int32)
    want, want_state = _ref_step(q, k, v, g, beta, state, slots.long())
    before = state.clone()
    got = recurrent_step(q, k, v, g, beta, state, slots, block_v=16)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    changed = (state != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == sorted(s for s in slots.tolist() if s >= 0)
    # all rows padding: nothing moves
    assert torch.equal(recurrent_step(q, k, v, g, beta, state, torch.full_like(slots, -1)), torch.zeros_like(v))
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_step_carries_the_state_over_steps(device, dtype):
    gen = torch.Generator().manual_seed(6)
    batch, hk, hv, dk, dv = 3, 1, 4, 32, 64
    state = _states(hv, dk, dv, device, gen)
    ref_state = state.clone()
    slots = _slots(batch, device)
    for _ in range(4):
        q, k, v, g, beta = _step_inputs(batch, hk, hv, dk, dv, dtype, device, gen)
        want, ref_state = _ref_step(q, k, v, g, beta, ref_state, slots)
        torch.testing.assert_close(recurrent_step(q, k, v, g, beta, state, slots), want, **_tol(dtype))
        torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


def test_recurrent_step_scale(device):
    """The default scale is Dk**-0.5; another scale changes the output (and only the output)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta = _step_inputs(2, 2, 2, 32, 32, torch.float32, device, gen)
    state = _states(2, 32, 32, device, gen)
    slots = _slots(2, device)
    s1, s2, s3 = state.clone(), state.clone(), state.clone()
    base = recurrent_step(q, k, v, g, beta, s1, slots)
    torch.testing.assert_close(recurrent_step(q, k, v, g, beta, s2, slots, scale=32 ** -0.5), base,
                               rtol=0, atol=0)
    doubled = recurrent_step(q, k, v, g, beta, s3, slots, scale=2 * 32 ** -0.5)
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-5, atol=1e-6)
    assert torch.equal(s1, s3)


def test_wrappers_reject_what_they_cannot_update_in_place(device):
    gen = torch.Generator().manual_seed(8)
    q, k, v, g, beta = _step_inputs(2, 2, 2, 16, 16, torch.float32, device, gen)
    state = _states(2, 16, 16, device, gen)
    slots = _slots(2, device)
    with pytest.raises(ValueError, match="contiguous"):
        recurrent_step(q, k, v, g, beta, state.transpose(2, 3), slots)
    with pytest.raises(ValueError, match="float32"):
        recurrent_step(q, k, v, g, beta, state.bfloat16(), slots)
    with pytest.raises(ValueError, match="multiple"):
        recurrent_step(q, k, v[:, :1].expand(2, 3, 16), g, beta, state, slots)
    x, weight, conv_state = _conv_inputs(2, 32, 4, torch.float32, torch.float32, device, gen)
    with pytest.raises(ValueError, match="int32/int64"):
        conv_update(x, weight, conv_state, slots.float())
    with pytest.raises(ValueError, match="do not fit"):
        conv_update(x, weight[:, :3], conv_state, slots)


@pytest.mark.parametrize("batch, heads", [(1, 32), (5, 4), (3, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decay_and_beta_match_the_torch_ops(device, batch, heads, dtype):
    """g = -exp(A_log) * softplus(a + dt_bias) (past softplus's threshold of 20 too) and beta = sigmoid(b) as
    GatedDeltaNet computes them in torch (beta in float32 here: the reference's sigmoid rounds to the dtype)."""
    gen = torch.Generator().manual_seed(batch * heads)
    a = (torch.randn(batch, 2 * heads, generator=gen) * 8).to(device, dtype)[:, :heads]  # strided rows: a view
    b = (torch.randn(batch, heads, generator=gen) * 4).to(device, dtype)
    a[0, 0] = 30.0  # softplus(x) = x past 20
    a_log = torch.randn(heads, generator=gen).to(device)
    dt_bias = torch.randn(heads, generator=gen).to(device)
    g, beta = decay_and_beta(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a.float() + dt_bias), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, torch.sigmoid(b.float()), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows, dim", [(1, 128), (7, 64), (12, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_rms_norm_matches_the_reference(device, rows, dim, dtype):
    """The gated norm's roundings as the torch reference (transformers' Qwen3_5RMSNormGated) makes them."""
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(device, dtype)
    gate = (torch.randn(rows, dim, generator=gen) * 2).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(device, dtype)
    want = gated_rms_norm_reference(x, gate, weight, 1e-6)
    got = gated_rms_norm(x, gate, weight, 1e-6)
    torch.testing.assert_close(got, want, **(dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else
                                             dict(rtol=2e-2, atol=2e-2)))
    if dtype != torch.float32:  # a few 16-bit ulps at most: the same roundings in the same places (a norm that
        # lands on the other side of a rounding boundary moves the product by an ulp or two)
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -6


@pytest.mark.parametrize("batch, heads, dim", [(1, 32, 128), (3, 4, 64), (5, 2, 40)])
def test_gated_rms_norm_reads_its_gate_from_a_strided_projection_view(device, batch, heads, dim):
    """The gate as the decode step hands it over: z, the tail of each row of in_proj_qkvz's output [B, C + H * D],
    viewed [B, H, D] (rows strided by C + H * D). Equal to the contiguous gate's result, bit for bit."""
    gen = torch.Generator().manual_seed(batch * heads + dim)
    x = (torch.randn(batch * heads, dim, generator=gen) * 3).to(device, torch.bfloat16)
    projection = torch.randn(batch, 96 + heads * dim, generator=gen).to(device, torch.bfloat16)
    z = projection[:, 96:].reshape(batch, heads, dim)  # a view: no copy
    assert z.data_ptr() == projection.data_ptr() + 96 * projection.element_size()
    weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(device, torch.bfloat16)
    got = gated_rms_norm(x, z, weight, 1e-6)
    assert torch.equal(got, gated_rms_norm(x, z.reshape(-1, dim).contiguous(), weight, 1e-6))
    torch.testing.assert_close(got, gated_rms_norm_reference(x, z.reshape(-1, dim), weight, 1e-6),
                               rtol=2e-2, atol=2e-2)


def test_gated_rms_norm_refuses_a_gate_of_other_rows(device):
    x = torch.randn(6, 16, device=device)
    with pytest.raises(ValueError, match=r"B \* H = N"):
        gated_rms_norm(x, torch.randn(2, 2, 16, device=device), torch.ones(16, device=device), 1e-6)
