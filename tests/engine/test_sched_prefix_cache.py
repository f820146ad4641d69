"""Prefix caching and preemption at the edges: colliding block keys, tiny KV caches, aborts in every state."""

from __future__ import annotations

import builtins

import pytest

from radiance import SamplingParams
from radiance.engine import block_manager
from radiance.engine.block_manager import BlockManager
from radiance.engine.sequence import Sequence


def _compute(bm: BlockManager, tokens: list[int], request_id: str = "r") -> Sequence:
    """Admit a sequence the way the scheduler does, compute all its tokens and register its full blocks."""
    seq = Sequence(request_id, tokens, SamplingParams(), 0)
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_a_cached_block_is_reused_only_after_its_own_prefix(monkeypatch):
    # what a crafted collision of Python's 64-bit hash() does: two different parents hash alike (here every
    # parent does). Block keys must not rest on it, or a block computed after (1, 1) serves a prompt of (2, 2).
    monkeypatch.setattr(block_manager, "hash", lambda key: builtins.hash(key[1]), raising=False)
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.free(_compute(bm, [1, 1, 5, 5, 9], "victim"))
    bm.free(_compute(bm, [2, 2, 9], "warm"))
    probe = Sequence("probe", [2, 2, 5, 5, 9], SamplingParams(), 0)
    assert bm.match_prefix(probe) == 2  # (2, 2) only: the cached (5, 5) followed (1, 1)


def test_equal_prefixes_still_share_blocks_across_evictions():
    bm = BlockManager(num_blocks=4, block_size=2)
    first = _compute(bm, [1, 2, 3, 4, 5])
    blocks = list(first.block_table[:2])
    bm.free(first)
    again = Sequence("again", [1, 2, 3, 4, 6], SamplingParams(), 0)
    assert bm.match_prefix(again) == 4 and again.block_table == blocks
    bm.free(again)
    bm.free(_compute(bm, [7, 7, 8, 8, 9, 9, 0]))  # takes every block: the old prefix is evicted
    assert bm.match_prefix(Sequence("late", [1, 2, 3, 4, 6], SamplingParams(), 0)) == 0


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate([21, 8, 16, 13, 5, 24])]


@pytest.fixture(scope="module")
def alone(tiny_llm):
    """Each prompt generated alone on a roomy engine."""
    llm = tiny_llm(enable_prefix_caching=False, max_num_seqs=1)
    return [llm.generate(p, GREEDY)[0].outputs[0] for p in PROMPTS]


@pytest.mark.parametrize("options", [
    dict(num_gpu_blocks_override=7, block_size=8, max_num_batched_tokens=5),  # chunks smaller than a block
    dict(num_gpu_blocks_override=6, block_size=8, enable_chunked_prefill=False),
    dict(num_gpu_blocks_override=9, block_size=4, max_num_batched_tokens=3, overlap_decode=True),
])
def test_preempted_sequences_resume_with_the_tokens_and_logprobs_they_had_alone(tiny_llm, alone, options):
    llm = tiny_llm(max_num_seqs=6, **options)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert all(o.finish_reason == "length" for o in outs)
    for out, ref in zip(outs, alone):
        # logprobs=0: each step's dict holds the sampled token only
        assert sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)) == \
            pytest.approx(sum(s[t].logprob for t, s in zip(ref.token_ids, ref.logprobs)), abs=1e-4)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # nothing leaked or freed twice


def _step_into(engine, finished: dict) -> None:
    for out in engine.step():
        if out.finished:
            assert out.request_id not in finished, "a request ended twice"
            finished[out.request_id] = out


def test_aborts_in_every_state_leave_the_others_exact(tiny_llm, alone):
    llm = tiny_llm(max_num_seqs=4, num_gpu_blocks_override=6, block_size=8, max_num_batched_tokens=16)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finished: dict = {}
    _step_into(engine, finished)
    engine.abort_request("0")  # running
    engine.abort_request("5")  # waiting
    engine.abort_request("5")  # twice
    engine.abort_request("nope")  # unknown
    preempted = None
    while preempted is None and engine.has_unfinished_requests():
        _step_into(engine, finished)
        preempted = next((s.request_id for s in engine.scheduler.waiting if s.admitted), None)
    assert preempted is not None
    engine.abort_request(preempted)  # preempted
    while engine.has_unfinished_requests():
        _step_into(engine, finished)
    engine.abort_request("1")  # already finished: nothing more comes
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert {rid for rid, out in finished.items() if out.finish_reason == "abort"} == {"0", "5", preempted}
    for rid, out in finished.items():
        if out.finish_reason != "abort":
            assert out.token_ids == alone[int(rid)].token_ids
    assert len(finished) == len(PROMPTS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_aborted_while_waiting_reports_no_cached_tokens(tiny_llm):
    """num_cached_tokens is set at admission: a request whose prefix matched while it waited for KV blocks, then
    aborted before it ran, used no cached token (it reported the match, which the prefix-cache counters never saw)."""
    from radiance import SamplingParams

    llm = tiny_llm(num_gpu_blocks_override=5, block_size=16, max_num_seqs=4)
    engine = llm.engine
    shared = [(3 * i + 1) % 256 for i in range(32)]
    engine.add_request("first", shared, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()  # its two prompt blocks are computed (cached) and it decodes in a third
    engine.add_request("waits", shared + [7] * 40, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the 40 new tokens need 3 blocks more than are free: it waits, its prefix matched
    waiting = engine.sequences["waits"]
    assert waiting.status.name == "WAITING" and not waiting.admitted
    engine.abort_request("waits")
    outs = [o for o in engine.step() if o.request_id == "waits"]
    assert outs and outs[-1].finish_reason == "abort" and outs[-1].num_cached_tokens == 0
    assert engine.stats().prefix_cache_hits_total == 0
