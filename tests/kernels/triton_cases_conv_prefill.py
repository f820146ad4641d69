"""The Gated DeltaNet prefill conv (causal_conv1d_prefill) vs the torch reference (layers/gated_delta.py's
causal_conv1d_varlen), run on CUDA or on the CPU through the Triton interpreter (test_triton_interpreter.py): several
sequences of different lengths in one launch, continuing beside fresh ones, sequences shorter than the window, slots
out of order, a padding slot, strided x, 16-bit weights, channel counts that are not powers of two."""

import pytest
import torch

from radiance.kernels._triton.conv_prefill import causal_conv1d_prefill
from radiance.layers.gated_delta import causal_conv1d_varlen

SLOTS = 10

# (q_lens, continues, slots); slot -1: a padding sequence
MIXES = {
    "one-seq": ([9], [False], [5]),
    "one-token": ([1], [True], [0]),
    "mixed": ([3, 70, 1, 2], [True, False, True, True], [5, 0, 2, 9]),  # 70: two row blocks; 1, 2: under K-1
    "fresh-short": ([2, 1, 5], [False, False, True], [8, 3, 1]),
    "padding": ([4, 3, 5], [True, True, False], [7, -1, 3]),
}


def _cu(lens, device):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu.to(device)


def _inputs(lens, channels, kernel, dtype, w_dtype, device, seed):
    """x a column slice of a wider row (as the projection's q|k|v columns), weight conv1d.weight[:, 0]."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(sum(lens), channels + 24, generator=gen).to(device, dtype)
    x = wide[:, 8:8 + channels]
    weight = (torch.randn(channels, 1, kernel, generator=gen) * 0.5).to(device, w_dtype)[:, 0]
    conv_state = torch.randn(SLOTS, channels, kernel - 1, generator=gen).to(device, dtype)
    return x, weight, conv_state


def _reference(x, weight, conv_state, lens, continues, slots):
    """causal_conv1d_varlen over the live sequences (slot >= 0) on a copy of the state; padding rows zeros."""
    state = conv_state.clone()
    out = torch.zeros_like(x)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    live = [i for i, s in enumerate(slots) if s >= 0]
    rows = torch.tensor([r for i in live for r in range(starts[i], starts[i] + lens[i])], dtype=torch.long,
                        device=x.device)
    if live:
        out[rows] = causal_conv1d_varlen(x[rows], weight, state, torch.tensor([slots[i] for i in live],
                                         device=x.device), [lens[i] for i in live], [continues[i] for i in live])
    return out, state


def _run(x, weight, conv_state, lens, continues, slots, slot_dtype=torch.int64):
    device = x.device
    return causal_conv1d_prefill(x, weight, conv_state, torch.tensor(slots, dtype=slot_dtype, device=device),
                                 _cu(lens, device), torch.tensor(continues, dtype=torch.int32, device=device),
                                 max(lens))


def _tol(dtype):
    """fp32: another silu formula, sums fused differently once compiled. bf16: one ulp (2**-7 relative) of the output,
    since the interpreter rounds fp32 to bf16 toward zero (torch and the GPU to nearest): about half the outputs."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("channels,kernel", [(48, 4), (200, 4), (200, 2)])  # 200: two masked channel blocks
@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=["fp32-w_fp32", "bf16-w_fp32", "bf16-w_bf16", "fp32-w_bf16"])
def test_prefill_conv_matches_reference(device, mix, channels, kernel, dtype, w_dtype):
    lens, continues, slots = MIXES[mix]
    x, weight, conv_state = _inputs(lens, channels, kernel, dtype, w_dtype, device, seed=sum(lens) + channels)
    want, want_state = _reference(x, weight, conv_state, lens, continues, slots)
    before = conv_state.clone()
    got = _run(x, weight, conv_state, lens, continues, slots, torch.int32 if mix == "mixed" else torch.int64)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(conv_state, want_state)  # copies of inputs: exact
    for i, s in enumerate(slots):
        if s < 0:  # padding rows: zeros, whatever the state or x hold
            start = sum(lens[:i])
            assert torch.equal(got[start:start + lens[i]], torch.zeros_like(got[start:start + lens[i]]))
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(conv_state[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_conv_fresh_slot_holding_nans(device, dtype):
    """A fresh sequence never reads its slot: NaNs there (an unused slot's memory) reach neither out nor state."""
    lens, continues, slots = [2, 6], [False, False], [4, 6]
    x, weight, conv_state = _inputs(lens, 48, 4, dtype, torch.float32, device, seed=11)
    conv_state[4] = float("nan")
    conv_state[6] = float("nan")
    want, want_state = _reference(x, weight, conv_state, lens, continues, slots)
    got = _run(x, weight, conv_state, lens, continues, slots)
    assert not got.isnan().any() and not conv_state[[4, 6]].isnan().any()
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(conv_state, want_state)


def test_prefill_conv_float32_state_with_strides(device):
    """conv_state float32 (x bf16) stored [S, K-1, C] and viewed [S, C, K-1]: old entries go through x's dtype, into
    the outputs and into the tails of the sequences shorter than the window. Each old entry is a bf16 value plus
    less than half an ulp, so that rounding it to nearest (torch) or toward zero (the interpreter) gives that value,
    and a kernel that did not round would keep the extra bits in the state."""
    lens, continues, slots = MIXES["mixed"]
    x, weight, _ = _inputs(lens, 48, 4, torch.bfloat16, torch.float32, device, seed=15)
    gen = torch.Generator().manual_seed(16)
    kept = torch.randn(SLOTS, 3, 48, generator=gen).to(torch.bfloat16).float()
    conv_state = (kept * (1 + 2 ** -10)).to(device).transpose(1, 2)
    want, want_state = _reference(x, weight, conv_state, lens, continues, slots)
    before = conv_state.clone()
    got = _run(x, weight, conv_state, lens, continues, slots)
    torch.testing.assert_close(got, want, **_tol(torch.bfloat16))
    assert torch.equal(conv_state, want_state)
    assert torch.equal(conv_state[2, :, :2], kept[2, 1:].T.to(device))  # q_len 1: old entries 1, 2 move down
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(conv_state[untouched], before[untouched])


def test_prefill_conv_chunks_chain_into_one_prefill(device):
    """A prompt prefilled in pieces (fresh, then continuing with pieces shorter and longer than the window) gives
    the rows and state of one prefill of the whole prompt."""
    lens = [11]
    x, weight, conv_state = _inputs(lens, 48, 4, torch.float32, torch.float32, device, seed=12)
    whole_state = conv_state.clone()
    whole = _run(x, weight, whole_state, lens, [False], [3])
    pieces, start = [], 0
    for i, n in enumerate([4, 1, 2, 4]):
        pieces.append(_run(x[start:start + n], weight, conv_state, [n], [i > 0], [3]))
        start += n
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_state, whole_state)


def test_prefill_conv_all_padding_and_loose_max_q_len(device):
    """Every sequence padding: zeros out, no slot touched. max_q_len only bounds the grid: a larger one changes
    nothing."""
    lens, continues, slots = [3, 5], [True, True], [2, 7]
    x, weight, conv_state = _inputs(lens, 48, 4, torch.float32, torch.float32, device, seed=13)
    before = conv_state.clone()
    cu, cont = _cu(lens, device), torch.ones(2, dtype=torch.int32, device=device)
    pad = torch.full((2,), -1, dtype=torch.int64, device=device)
    assert torch.equal(causal_conv1d_prefill(x, weight, conv_state, pad, cu, cont, 5), torch.zeros_like(x))
    assert torch.equal(conv_state, before)
    want, want_state = _reference(x, weight, conv_state, lens, continues, slots)
    got = causal_conv1d_prefill(x, weight, conv_state, torch.tensor(slots, device=device), cu, cont, 100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_state, want_state)


def test_prefill_conv_rejects_bad_arguments(device):
    x, weight, conv_state = _inputs([3, 2], 48, 4, torch.float32, torch.float32, device, seed=14)
    slots = torch.tensor([1, 2], device=device)
    cu, cont = _cu([3, 2], device), torch.ones(2, dtype=torch.int32, device=device)

    def call(**kw):
        args = dict(x=x, weight=weight, conv_state=conv_state, state_slots=slots, cu_seqlens=cu, continues=cont,
                    max_q_len=3)
        return causal_conv1d_prefill(**{**args, **kw})

    with pytest.raises(ValueError, match="expects x"):
        call(x=x[None])
    with pytest.raises(ValueError, match="do not fit"):
        call(weight=weight[:40])
    with pytest.raises(ValueError, match="do not fit"):
        call(conv_state=conv_state[:, :, :2])
    with pytest.raises(ValueError, match="K >= 2"):
        call(weight=weight[:, :1], conv_state=conv_state[:, :, :0])
    with pytest.raises(ValueError, match="state_slots must be"):
        call(state_slots=slots.float())
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        call(cu_seqlens=cu[:2])
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        call(cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="continues must be"):
        call(continues=cont[:1])
    with pytest.raises(ValueError, match="continues must be"):
        call(continues=cont.bool())
    with pytest.raises(ValueError, match="float32/16-bit"):
        call(x=x.double(), weight=weight.double(), conv_state=conv_state.double())
    with pytest.raises(ValueError, match="channels must be contiguous"):
        call(x=torch.randn(48, 5, device=device).t())
    with pytest.raises(ValueError, match="max_q_len"):
        call(max_q_len=-1)
