"""Unit tests of the block manager, the sampler and the sampling parameters."""

from __future__ import annotations

import numpy
import pytest
import torch

from radiance.engine.block_manager import BlockManager
from radiance.engine.sampling_params import SamplingParams
from radiance.engine.sequence import Sequence
from radiance.errors import RadianceError
from radiance.layers.sampler import SamplingRow, sample


def _seq(tokens, rid="r"):
    return Sequence(rid, tokens, SamplingParams(), 0)


def test_block_manager_prefix_reuse_and_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _seq(list(range(10)))
    assert bm.match_prefix(a) == 0
    bm.allocate(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 3
    a.num_computed_tokens = 10
    bm.commit(a)  # blocks 0-1 full and hashed, the third partial
    b = _seq(list(range(9)) + [99], "b")
    assert bm.match_prefix(b) == 8  # two shared blocks
    assert b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    c = _seq(list(range(8)), "c")
    assert bm.match_prefix(c) == 4  # the last token is always recomputed: only one full block reused
    bm.free(a), bm.free(b), bm.free(c)
    assert bm.num_free_blocks == 6
    d = _seq(list(range(10)), "d")  # freed blocks keep their contents until reused
    assert bm.match_prefix(d) == 8
    bm.free(d)
    e = _seq([7] * 24, "e")  # takes every block: the cached ones get evicted
    bm.allocate(e, 24)
    bm.free(e)
    assert bm.match_prefix(_seq(list(range(10)), "f")) == 0


def test_block_manager_without_prefix_caching():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = _seq(list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free(a)
    assert bm.match_prefix(_seq(list(range(9)), "b")) == 0
    assert not bm.can_allocate(_seq(list(range(17)), "c"), 17)


def test_block_manager_extends_a_sequence_in_order_when_asked():
    """prefer_in_order (the CPU engine): a growing sequence takes the block after its last one while it
    is free, else the least recently freed; a fresh sequence starts at the LRU block as before."""
    def run(prefer: bool):
        bm = BlockManager(num_blocks=8, block_size=4, prefer_in_order=prefer)
        a, b, c = _seq(list(range(12))), _seq([5] * 4, "b"), _seq([6] * 4, "c")
        for s in (a, b, c):
            bm.allocate(s, 4)  # blocks 0, 1, 2
        bm.free(b)  # block 1 goes to the back of the LRU order: 3, 4, ..., 7, 1
        a.num_computed_tokens = 4
        bm.allocate(a, 4)
        c.num_computed_tokens = 4
        bm.allocate(c, 4)  # block 3 is free in both orders
        d = _seq([7] * 4, "d")
        bm.allocate(d, 4)
        return a.block_table, c.block_table, d.block_table

    assert run(prefer=True) == ([0, 1], [2, 3], [4])
    assert run(prefer=False) == ([0, 3], [2, 4], [5])


def test_in_order_extension_keeps_another_prompts_cached_block():
    """Two prompts sharing their first block (a system prompt): the second one's next block came right after the
    shared one, which was the first prompt's cached continuation, so each evicted the other's with free blocks
    to spare."""
    bm = BlockManager(num_blocks=16, block_size=4, prefer_in_order=True)
    shared = [1, 2, 3, 4]
    a = _seq(shared + [10, 11, 12, 13, 14])
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)  # blocks 0 (shared) and 1 (a's own) stay cached
    b = _seq(shared + [20, 21, 22, 23, 24], "b")
    assert bm.match_prefix(b) == 4 and b.block_table == [0]
    bm.allocate(b, 5)
    assert b.block_table[1] != 1  # not a's cached block, though it follows the shared one
    b.num_computed_tokens = 9
    bm.commit(b)
    bm.free(b)
    assert bm.match_prefix(_seq(shared + [10, 11, 12, 13, 14], "again")) == 8  # a's two blocks are still cached


def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1).tolist()
    rows = [SamplingRow(0.0), SamplingRow(1.0, top_k=1), SamplingRow(1.0, top_p=1e-6), SamplingRow(1.0, min_p=1.0)]
    assert sample(logits, rows).token_ids == greedy
    # top-k=3 only ever returns one of the 3 best tokens
    best3 = set(logits[0].topk(3).indices.tolist())
    many = sample(logits[:1].repeat(300, 1), [SamplingRow(1.5, top_k=3)] * 300).token_ids
    assert set(many) <= best3 and len(set(many)) == 3


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-300])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    """logits / 1e-40 overflow float32 to inf and the softmax to NaN: the embedded model answered token 0 over and
    over through the server. Below sampler.GREEDY_BELOW a row takes the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 30  # wide logits: inf - inf is what made NaN
    assert sample(logits, [SamplingRow(temperature)] * 64).token_ids == logits.argmax(-1).tolist()
    # SamplingParams raises such a temperature to 0.01, as vLLM does (the sampler's guard stays for its other callers)
    assert SamplingParams(temperature=temperature).temperature == 0.01 and not SamplingParams(temperature=1e-4).greedy


def test_a_top_k_past_int64_is_the_whole_vocabulary():
    """A client's top_k of 2**70 overflowed the sampler's int64 tensor inside the engine loop, which stopped the
    engine for every later request."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ids = torch.tensor(sample(probs.log().repeat(4000, 1), [SamplingRow(1.0, top_k=2**70)] * 4000).token_ids)
    assert torch.allclose(torch.bincount(ids, minlength=4).float() / 4000, probs, atol=0.03)


def test_sampler_matches_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    ids = torch.tensor(sample(logits, [SamplingRow(1.0)] * 4000).token_ids)
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # top_p=0.8 keeps 0.5 and 0.3 (the 0.15 starts above 0.8 of mass), renormalized 5:3
    ids = torch.tensor(sample(logits, [SamplingRow(1.0, top_p=0.8)] * 4000).token_ids)
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.03


def test_seeded_rows_are_reproducible():
    logits = torch.randn(1, 1000)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, [SamplingRow(1.0, generator=g)]).token_ids[0] for _ in range(20)]

    assert draw(7) == draw(7) and draw(7) != draw(8)


def test_logprobs_rows():
    logits = torch.randn(2, 30)
    out = sample(logits, [SamplingRow(0.0, num_logprobs=2), SamplingRow(0.0)])
    chosen, top, rank = out.logprobs[0]
    assert out.logprobs[1] is None
    assert chosen == pytest.approx(logits[0].log_softmax(-1).max().item(), abs=1e-5)
    assert [t for t, _ in top] == logits[0].topk(2).indices.tolist()
    assert rank == 1  # greedy: nothing is more likely


def test_a_sampled_token_s_rank_counts_the_tokens_more_likely_than_it():
    """vLLM ranks every sampled token; the engine left a sampled token's rank None, so LLM.generate could name it
    only when it ranked among the returned alternatives."""
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    out = sample(logits, [SamplingRow(5.0, num_logprobs=1) for _ in range(64)])  # hot: many tokens below the top 1
    for row, (token, (_, _, rank)) in enumerate(zip(out.token_ids, out.logprobs)):
        lp = logits[row].log_softmax(-1)  # vLLM counts on the logprobs
        assert rank == 1 + int((lp > lp[token]).sum())
    assert max(rank for _, _, rank in out.logprobs) > 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(top_k=-2),
                                 dict(min_p=2), dict(n=0)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError, match=f"^{next(iter(bad))} "):  # the message names the parameter
        SamplingParams(**bad)


def test_block_table_mirror_follows_appends_and_new_lists():
    """The runner's numpy block tables: extended as a table grows, rebuilt when the sequence gets a new list
    (its blocks were freed: preemption), a local group's released entries updated in place: equal to the list
    every time."""
    from radiance.engine.step_inputs import BlockTableMirror

    class Seq:
        block_table: list

    mirror, seq = BlockTableMirror(), Seq()
    seq.block_table = [7, 3]
    first = mirror.row(seq)
    assert first.tolist() == [7, 3] and mirror.row(seq) is first  # unchanged: no copy
    seq.block_table.append(9)
    assert mirror.row(seq).tolist() == [7, 3, 9]
    seq.block_table = [5, 6, 8]  # freed and reallocated: same length, new list
    assert mirror.row(seq).tolist() == [5, 6, 8]
    seq.block_table = []
    assert mirror.row(seq).tolist() == []
    other = Seq()
    other.block_table = [1]
    assert mirror.row(other).tolist() == [1] and mirror.row(seq).tolist() == []  # one row per sequence
    # KV groups: one row per group; a local group's released entries come as a new list of the same length
    seq.block_table, seq.group_tables = [1, 2], [[3, 4]]
    assert mirror.row(seq, 1).tolist() == [3, 4] and mirror.row(seq).tolist() == [1, 2]
    seq.group_tables[0] = [99, 4]
    assert mirror.row(seq, 1).tolist() == [99, 4]
    # a local group's entries behind its span are released in place, Sequence.released_blocks counting them
    held = mirror.row(seq, 1)
    seq.group_tables[0][0], seq.released_blocks = -1, [0, 1]
    assert mirror.row(seq, 1).tolist() == [-1, 4] and held.tolist() == [99, 4]  # an array handed out stays
    seq.group_tables[0].extend([5, 6])
    seq.group_tables[0][1], seq.released_blocks = -1, [0, 2]  # grown and released since the last step
    assert mirror.row(seq, 1).tolist() == [-1, -1, 5, 6] and mirror.row(seq).tolist() == [1, 2]


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("repetition_penalty", float("inf")),  # inf / inf made NaN logits
    ("max_tokens", 2.5), ("n", 1.5), ("top_k", 1.5), ("seed", 1.5), ("logprobs", 0.5), ("prompt_logprobs", 1.5),
    ("stop", 5), ("stop", [None]), ("stop", ["ok", 3]), ("stop_token_ids", [1.5]), ("stop_token_ids", ["7"]),
    # a string or None where a number belongs raised a bare TypeError; "no" for ignore_eos was true
    ("temperature", "0.5"), ("top_p", None), ("min_p", [0.1]), ("repetition_penalty", "2"),
    ("presence_penalty", None), ("frequency_penalty", "1"), ("n", True), ("max_tokens", True),
    ("ignore_eos", "no"), ("skip_special_tokens", 2),
])
def test_sampling_params_name_the_field_of_a_bad_value(field, value):
    """Non-finite floats and non-integers where an integer belongs were accepted, and failed later inside the
    engine (a float seed raised RuntimeError in add_request, which stopped the async engine's loop)."""
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, RadianceError)  # what the server answers with a 400


def test_sampling_params_take_numpy_scalars():
    params = SamplingParams(temperature=numpy.float32(0.5), top_k=numpy.int64(3), ignore_eos=numpy.bool_(True),
                            skip_special_tokens=0)
    assert params.ignore_eos is True and params.skip_special_tokens is False and params.top_k == 3


def test_a_choice_of_an_n_request_is_one_sequence_with_its_own_seed():
    p = SamplingParams(n=3, temperature=0.7, seed=41, max_tokens=9, stop=["x"])
    second = p.for_choice(2)
    assert (second.n, second.seed, second.temperature, second.max_tokens, second.stop) == (1, 43, 0.7, 9, p.stop)
    assert SamplingParams(n=2, temperature=0.7).for_choice(1).seed is None  # unseeded stays unseeded
