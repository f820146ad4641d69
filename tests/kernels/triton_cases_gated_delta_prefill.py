"""The Gated DeltaNet prefill kernels (recurrent_prefill, which serves; chunked_prefill, not yet fast enough to) vs
the torch reference's chunked form (layers/gated_delta.gated_delta_rule_varlen), run on CUDA or on the CPU through
the Triton interpreter (test_triton_interpreter.py): several sequences of different lengths in one launch, across
the reference's 64-token chunks, sequences that continue their slot's state beside ones that start fresh, slots out
of order, strided views, a padding slot."""

import pytest
import torch
import torch.nn.functional as F

from radiance.kernels._triton.gated_delta_chunked import (INVERSES, chunked_prefill, default_output_precision,
                                                         delta_chunks)
from radiance.kernels._triton.gated_delta_prefill import recurrent_prefill
from radiance.layers.gated_delta import gated_delta_rule_varlen

SLOTS = 8


def _inputs(lens, hk, hv, dk, dv, dtype, device, seed):
    """q | k | v as views of one conv-output row per token, as the layer hands them over; g, beta as its gates."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    mixed = (torch.randn(total, 2 * hk * dk + hv * dv, generator=gen) * 2).to(device, dtype)
    q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    q, k, v = q.reshape(total, hk, dk), k.reshape(total, hk, dk), v.reshape(total, hv, dv)
    g = F.logsigmoid(torch.randn(total, hv, generator=gen) + 2).to(device)  # decays near 1, as trained models'
    beta = torch.sigmoid(torch.randn(total, 2 * hv, generator=gen)).to(device, dtype)[:, hv:]  # strided rows
    state = torch.randn(SLOTS, hv, dk, dv, generator=gen).to(device) * 0.1
    return q, k, v, g, beta, state


def _cu(lens, device):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu.to(device)


MIXED = [True, False, True, False]
SMALL, ODD = ((1, 2), (16, 16)), ((2, 4), (24, 40))  # (Hk, Hv), (Dk, Dv); ODD: two value heads per key head


@pytest.mark.parametrize("lens, continues, heads, dims, dtype", [
    ([9], [False], *SMALL, torch.float32), ([9], [False], *SMALL, torch.bfloat16),
    ([70], [True], *SMALL, torch.float32),  # past the reference's 64-token chunk
    ([3, 66, 1, 20], MIXED, *SMALL, torch.float32), ([3, 66, 1, 20], MIXED, *SMALL, torch.bfloat16),
    ([3, 12, 1, 5], MIXED, *ODD, torch.float32), ([3, 12, 1, 5], MIXED, *ODD, torch.bfloat16)])
def test_recurrent_prefill_matches_the_chunked_reference(device, lens, continues, heads, dims, dtype):
    _check_against_reference(lambda *args, cu, chunks: recurrent_prefill(*args[:7], cu, args[7], block_v=16),
                             lens, continues, heads, dims, dtype, device, seed=sum(lens) + heads[1] + dims[0])


def _check_against_reference(prefill, lens, continues, heads, dims, dtype, device, seed):
    """prefill(q, k, v, g, beta, state, slots, continues, cu=..., chunks=...) against gated_delta_rule_varlen: the
    outputs, the final states at the sequences' slots, every other slot untouched."""
    (hk, hv), (dk, dv) = heads, dims
    q, k, v, g, beta, state = _inputs(lens, hk, hv, dk, dv, dtype, device, seed=seed)
    slots = torch.tensor([5, 0, 3, 6][:len(lens)], device=device)
    want_state = state.clone()
    want = gated_delta_rule_varlen(q, k, v, g, beta, want_state, slots, lens, continues)
    before = state.clone()
    got = prefill(q, k, v, g, beta, state, slots, torch.tensor(continues, device=device), cu=_cu(lens, device),
                  chunks=delta_chunks(lens, device))
    assert got.dtype == dtype and got.shape == v.shape
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)  # fp32 states from the same inputs
    untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_a_fresh_sequence_ignores_its_slot_and_a_padding_slot_is_untouched(device):
    """continues 0: the slot's old contents (here NaN) are not read; slot -1: nothing read or written."""
    lens = [5, 4]
    q, k, v, g, beta, state = _inputs(lens, 1, 2, 16, 16, torch.float32, device, seed=3)
    state[2] = float("nan")
    slots = torch.tensor([2, -1], device=device)
    got = recurrent_prefill(q, k, v, g, beta, state, slots, _cu(lens, device), torch.tensor([0, 1], device=device))
    clean = torch.zeros_like(state[:1])
    want = gated_delta_rule_varlen(q[:5], k[:5], v[:5], g[:5], beta[:5], clean, torch.tensor([0], device=device),
                                   [5], [False])
    torch.testing.assert_close(got[:5], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[2], clean[0], rtol=1e-4, atol=1e-4)


def test_recurrent_prefill_refuses_mismatched_inputs(device):
    q, k, v, g, beta, state = _inputs([4], 1, 2, 16, 16, torch.float32, device, seed=4)
    slots, cu = torch.tensor([0], device=device), _cu([4], device)
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent_prefill(q, k, v, g, beta, state, slots, cu[:1], torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="float32"):
        recurrent_prefill(q, k, v, g.half(), beta, state, slots, cu, torch.tensor([1], device=device))


@pytest.mark.parametrize("lens, continues, heads, dims, dtype", [
    ([9], [False], *SMALL, torch.float32),
    ([70], [True], *SMALL, torch.float32),  # a whole chunk and a partial one, continuing a state
    ([3, 66, 1, 20], MIXED, *SMALL, torch.bfloat16),
    ([3, 70, 1, 5], MIXED, *ODD, torch.float32),
    ([70, 2], [False, True], (2, 4), (12, 8), torch.float32)])  # head dims below tl.dot's 16: padded
@pytest.mark.parametrize("inverse", INVERSES)
def test_chunked_prefill_matches_the_chunked_reference(device, lens, continues, heads, dims, dtype, inverse):
    """The chunked form: chunks of 64 tokens per sequence, a sequence of one token a chunk of one row, odd head dims
    padded to powers of two, two value heads per key head; both ways of inverting a chunk's interactions."""
    _check_against_reference(lambda *args, cu, chunks: chunked_prefill(*args[:7], chunks, args[7], block_v=16,
                                                                       inverse=inverse),
                             lens, continues, heads, dims, dtype, device, seed=sum(lens) * 3 + heads[1])


@pytest.mark.parametrize("block_v, output_block_v", [(16, 64), (32, 16)])
def test_the_output_launch_takes_its_own_column_block(device, block_v, output_block_v):
    """The output launch's state columns apart from the scan's (40 value columns: one program past Dv's end, or
    three); a block that is no power of two is refused."""
    lens, continues = [70, 5], [True, False]
    _check_against_reference(
        lambda *args, cu, chunks: chunked_prefill(*args[:7], chunks, args[7], block_v=block_v, inverse="doubling",
                                                  output_block_v=output_block_v),
        lens, continues, *ODD, torch.float32, device, seed=block_v + output_block_v)
    q, k, v, g, beta, state = _inputs(lens, *ODD[0], *ODD[1], torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="output_block_v"):
        chunked_prefill(q, k, v, g, beta, state, torch.tensor([4, 1], device=device), delta_chunks(lens, device),
                        torch.tensor(continues, device=device), output_block_v=48)


def test_the_output_launch_drops_to_single_tf32_only_for_a_16_bit_output_under_tf32x3():
    assert default_output_precision("tf32x3", torch.bfloat16) == "tf32"
    assert default_output_precision("tf32x3", torch.float16) == "tf32"
    assert default_output_precision("tf32x3", torch.float32) == "tf32x3"  # fp32 outputs keep fp32's accuracy
    assert default_output_precision("ieee", torch.bfloat16) == "ieee"  # asked for fp32 products: all of them


def test_the_output_launch_takes_its_own_precision_and_warps(device):
    """Single tf32 products and 8 warps in the output launch alone (the prepare and scan keep tf32x3 and their
    warps): within a bf16 output's tolerance; a precision tl.dot does not know is refused by name."""
    lens, continues = [70, 5], [True, False]
    _check_against_reference(
        lambda *args, cu, chunks: chunked_prefill(*args[:7], chunks, args[7], output_precision="tf32",
                                                  output_warps=8),
        lens, continues, *SMALL, torch.bfloat16, device, seed=11)
    q, k, v, g, beta, state = _inputs(lens, *SMALL[0], *SMALL[1], torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="output_precision"):
        chunked_prefill(q, k, v, g, beta, state, torch.tensor([4, 1], device=device), delta_chunks(lens, device),
                        torch.tensor(continues, device=device), output_precision="fp16")


@pytest.mark.parametrize("scan_stages", [1, 2, 4])
def test_the_scan_takes_its_own_pipeline_depth(device, scan_stages):
    """The scan loop at 1 (no prefetch), 2 and 4 software pipeline stages over several chunks of two sequences: the
    recurrent form's results."""
    lens, continues = [200, 70], [True, False]
    _check_against_reference(
        lambda *args, cu, chunks: chunked_prefill(*args[:7], chunks, args[7], scan_stages=scan_stages),
        lens, continues, *SMALL, torch.float32, device, seed=5)


@pytest.mark.parametrize("precision, tol", [("ieee", 1e-4), ("tf32x3", 1e-4), ("tf32", 3e-2)])
def test_chunked_prefill_on_the_tensor_cores(device, precision, tol):
    """tl.dot's tf32x3 (about fp32) and tf32 (10-bit mantissas) inputs, fewer warps: the same results within their
    precision."""
    lens, continues = [70, 5], [True, False]
    q, k, v, g, beta, state = _inputs(lens, 1, 2, 16, 16, torch.float32, device, seed=21)
    slots = torch.tensor([4, 1], device=device)
    want_state = state.clone()
    want = gated_delta_rule_varlen(q, k, v, g, beta, want_state, slots, lens, continues)
    got = chunked_prefill(q, k, v, g, beta, state, slots, delta_chunks(lens, device),
                          torch.tensor(continues, device=device), precision=precision, num_warps=4, scan_warps=4)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="precision"):
        chunked_prefill(q, k, v, g, beta, state, slots, delta_chunks(lens, device),
                        torch.tensor(continues, device=device), precision="bf16")
    with pytest.raises(ValueError, match="inverse"):
        chunked_prefill(q, k, v, g, beta, state, slots, delta_chunks(lens, device),
                        torch.tensor(continues, device=device), inverse="power")


@pytest.mark.parametrize("inverse", INVERSES)
def test_chunked_prefill_keeps_repeated_keys_exact(device, inverse):
    """Every token the same key (a repeated token): the chunk's interactions are all ones below the diagonal, whose
    inverse a power series could not take in fp32; the forward substitution and the recurrent form agree."""
    lens = [64]
    q, k, v, g, beta, state = _inputs(lens, 1, 2, 16, 16, torch.float32, device, seed=11)
    k = k[:1].expand(64, -1, -1)
    q = q[:1].expand(64, -1, -1)
    g = torch.zeros_like(g)
    beta = torch.ones_like(beta)
    slots, flags = torch.tensor([1], device=device), torch.tensor([1], device=device)
    s1, s2 = state.clone(), state.clone()
    want = recurrent_prefill(q, k, v, g, beta, s1, slots, _cu(lens, device), flags)
    got = chunked_prefill(q, k, v, g, beta, s2, slots, delta_chunks(lens, device), flags, inverse=inverse)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s1, rtol=1e-4, atol=1e-4)


def test_delta_chunks_cut_each_sequence_on_its_own():
    chunks = delta_chunks([3, 130, 0, 64], torch.device("cpu"))
    assert chunks.starts.tolist() == [0, 3, 67, 131, 133] and chunks.lens.tolist() == [3, 64, 64, 2, 64]
    assert chunks.first_chunk.tolist() == [0, 1, 4, 4, 5] and chunks.count == 5


@pytest.mark.parametrize("lens, keep, heads, dims", [([200], [(0, 3, 7)], *SMALL),
                                                     ([3, 130, 1, 70], [(1, 2, 1), (3, 1, 7)], *ODD)])
def test_chunked_prefill_keeps_the_states_entering_chosen_chunks(device, lens, keep, heads, dims):
    """keep (a chunk of the table, a row): the state entering the chunk (its sequence's state after that many
    64-token chunks) copied into the row, as the torch form's keep (sequence, chunk, row) does; the slots' final
    states as without it."""
    (hk, hv), (dk, dv) = heads, dims
    q, k, v, g, beta, state = _inputs(lens, hk, hv, dk, dv, torch.float32, device, seed=sum(lens))
    slots = torch.tensor([5, 0, 3, 6][:len(lens)], device=device)
    continues = [True] * len(lens)
    want = state.clone()
    gated_delta_rule_varlen(q, k, v, g, beta, want, slots, lens, continues, keep=keep)
    first = [0]
    for n in lens:
        first.append(first[-1] + -(-n // 64))
    chunked_prefill(q, k, v, g, beta, state, slots, delta_chunks(lens, device), torch.tensor(continues, device=device),
                    keep=tuple((first[seq] + chunk, row) for seq, chunk, row in keep))
    torch.testing.assert_close(state, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_both_forms_write_into_a_given_output(device, form):
    """`out` (a piecewise CUDA graph's static buffer: rows past the step's sequences pad it to its bucket): the
    sequences' rows written as a new output's, the padding rows left as they were; a buffer of another shape or
    dtype is refused."""
    lens, continues = [70, 5], [True, False]
    q, k, v, g, beta, state = _inputs(lens + [5], 1, 2, 16, 16, torch.float32, device, seed=31)  # 5 padding rows
    slots, flags = torch.tensor([4, 1], device=device), torch.tensor(continues, device=device)

    def run(state, out=None):
        if form == "recurrent":
            return recurrent_prefill(q, k, v, g, beta, state, slots, _cu(lens, device), flags, out=out)
        return chunked_prefill(q, k, v, g, beta, state, slots, delta_chunks(lens, device), flags, out=out)

    want = run(state.clone())
    buffer = torch.full((80, 2, 16), 7.0, device=device)
    got = run(state.clone(), out=buffer)
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:75], want[:75], rtol=0, atol=0)
    assert bool((buffer[75:] == 7.0).all())
    with pytest.raises(ValueError, match="out must be"):
        run(state.clone(), out=buffer[:75])
    with pytest.raises(ValueError, match="out must be"):
        run(state.clone(), out=buffer.to(torch.bfloat16))
