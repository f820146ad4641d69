"""Overlapped decode beside a request that waits for KV blocks: the engine queues a decode step ahead unless the
next schedule admits a waiting request, which Scheduler.admits_next foretells by schedule()'s own rule (free
blocks, watermark, cached prefix, sequences finishing) without touching anything."""

from __future__ import annotations

import pytest

from radiance import SamplingParams
from radiance.config import SchedulerConfig
from radiance.engine.block_manager import BlockManager
from radiance.engine.scheduler import Scheduler
from radiance.engine.sequence import Sequence

PROMPT = [5, 9, 9, 200, 17, 3, 41, 250, 7]
LONG_PROMPT = [(11 * j + 4) % 240 + 10 for j in range(36)]  # 9 blocks of 4: beside PROMPT's 3 to 7 never fits


def _run(tiny_llm, overlap: bool):
    """A runs; once it decodes, B arrives, too large for the blocks A leaves free (12 in all), and waits for A
    to finish. Returns the finished outputs and the steps served by a step queued ahead while B waited."""
    engine = tiny_llm(max_num_seqs=4, block_size=4, num_gpu_blocks_override=12, overlap_decode=overlap).engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    done = {o.request_id: o.token_ids for o in engine.step() if o.finished}
    engine.add_request("b", LONG_PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    overlapped_while_waiting = 0
    while engine.has_unfinished_requests():
        b_waits = engine.sequences["b"] in engine.scheduler.waiting
        before = engine.overlapped_steps
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        if b_waits:
            overlapped_while_waiting += engine.overlapped_steps - before
    return done, overlapped_while_waiting


def test_a_request_waiting_for_blocks_leaves_the_decode_overlapped(tiny_llm):
    """The engine gave up the overlap whenever a request waited and a sequence slot was free, sure that the next
    schedule admits it; one that waits for blocks kept every step of the running ones from overlapping."""
    plain, none_ahead = _run(tiny_llm, overlap=False)
    overlapped, ahead = _run(tiny_llm, overlap=True)
    assert none_ahead == 0 and ahead > 0
    assert overlapped == plain and [len(plain["a"]), len(plain["b"])] == [16, 8]


# ---------------------------------------------------------------- Scheduler.admits_next against schedule()


def _scheduler(num_blocks: int = 12) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4), BlockManager(num_blocks=num_blocks, block_size=4))


def _decoding(sched: Scheduler, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence admitted alone, its prompt computed and its first token sampled, with the block of its next
    decode taken (as the engine takes it when it queues that decode ahead)."""
    seq = Sequence(request_id, tokens, SamplingParams(), 0)
    sched.add(seq)
    [step] = [s for s in sched.schedule() if s.seq is seq]
    seq.num_computed_tokens += step.num_new_tokens
    sched.block_manager.commit(seq)
    seq.append_token(1)
    sched.block_manager.allocate(seq, 1)
    return seq


def _foretold(sched: Scheduler, head: Sequence, leaving: tuple[Sequence, ...] = ()) -> bool:
    """admits_next's answer, checked to change nothing and to be what schedule() then does."""
    bm = sched.block_manager
    state = (list(bm.free_blocks), list(bm.ref_counts), list(head.block_table), head.num_computed_tokens,
             head.num_cached_tokens, list(sched.waiting), list(sched.running))
    answer = sched.admits_next(list(leaving))
    assert state == (list(bm.free_blocks), list(bm.ref_counts), list(head.block_table), head.num_computed_tokens,
                     head.num_cached_tokens, list(sched.waiting), list(sched.running))
    for seq in leaving:
        sched.remove(seq)
    assert answer == (head in [s.seq for s in sched.schedule()])
    return answer


def _fresh(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_head_too_large_beside_the_running_is_not_admitted():
    sched = _scheduler()
    _decoding(sched, "a", _fresh(20, 100))  # 6 blocks with its next decode's; 6 free
    head = Sequence("b", _fresh(28, 300), SamplingParams(), 0)  # 7 blocks and the watermark's
    sched.add(head)
    assert _foretold(sched, head) is False


def test_a_head_admitted_on_the_blocks_it_shares_with_a_running_sequence():
    """Cached prefix blocks a running sequence holds cost no free block: admitted where its length says no."""
    sched = _scheduler()
    a = _decoding(sched, "a", _fresh(20, 100))
    head = Sequence("b", a.token_ids[:16] + _fresh(12, 300), SamplingParams(), 0)  # 4 blocks shared, 3 new
    sched.add(head)
    assert _foretold(sched, head) is True


def test_a_sequence_finishing_first_frees_its_blocks_and_its_slot():
    sched = _scheduler()
    _decoding(sched, "a", _fresh(20, 100))  # 6 blocks
    c = _decoding(sched, "c", _fresh(8, 200))  # 3 blocks; 3 free
    head = Sequence("b", _fresh(12, 300), SamplingParams(), 0)  # 3 blocks and the watermark's
    sched.add(head)
    assert sched.admits_next() is False
    assert _foretold(sched, head, leaving=(c,)) is True


def test_cached_blocks_a_finishing_sequence_frees_are_taken_back_off_the_free_list():
    """c's 2 full blocks start the head's prompt: once c is gone they are free, but admission takes them back."""
    sched = _scheduler()
    _decoding(sched, "a", _fresh(20, 100))
    c = _decoding(sched, "c", _fresh(8, 200))
    head = Sequence("b", c.token_ids[:8] + _fresh(16, 300), SamplingParams(), 0)  # 2 cached, 4 new: 5 of 4 free
    sched.add(head)
    assert _foretold(sched, head, leaving=(c,)) is False


@pytest.mark.parametrize("max_num_seqs, expected", [(2, False), (3, True)])
def test_no_slot_or_no_budget_admits_nothing(max_num_seqs, expected):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), BlockManager(num_blocks=12, block_size=4))
    _decoding(sched, "a", _fresh(4, 100))
    _decoding(sched, "c", _fresh(4, 200))
    head = Sequence("b", _fresh(4, 300), SamplingParams(), 0)
    sched.add(head)
    assert _foretold(sched, head) is expected
