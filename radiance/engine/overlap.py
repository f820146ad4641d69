"""Overlapped decode. While the host reads step n's tokens and does its bookkeeping, step n+1 (same sequences,
each advanced by its step-n token, taken from the device) is already queued. The next schedule uses it when it
asks for those sequences' decodes, or a subset of them (some finished); anything else (a new admission, a
preemption) discards it. A discarded step only wrote K/V at each sequence's next slot, which the step that
replaces it rewrites, or which belonged to a sequence that is gone; its partial block is never in the prefix
cache. A model with recurrent state (Qwen3.5's linear attention) cannot discard one: it advanced the states. Its
steps queued ahead are `pinned`: the next schedule admits nobody (the queued step holds every running sequence
but those finishing, and their blocks for it), so it asks for the queued decodes or a subset."""

from __future__ import annotations

from radiance.engine.block_manager import BlockManager
from radiance.engine.model_runner import ModelRunner
from radiance.engine.scheduler import ScheduledSequence, Scheduler
from radiance.engine.speculation import NgramSpeculator


class DecodeAhead:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, block_manager: BlockManager,
                 speculator: NgramSpeculator, max_model_len: int, pinned: bool = False):
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.speculator = speculator
        self.max_model_len = max_model_len
        self.queued = None  # (the queued step's handle, each sequence's position in it)
        self.overlapped_steps = 0  # steps served by a step queued ahead
        self.pinned = pinned  # a queued step is never discarded: the next schedule admits nobody

    def admits(self) -> bool:
        """Whether the next schedule may admit waiting requests (not while a pinned step is queued)."""
        return not (self.pinned and self.queued is not None)

    def take(self, scheduled: list[ScheduledSequence]):
        """The queued step restricted to `scheduled` when it computes exactly these decodes, else None; the
        queued step is consumed either way."""
        queued, self.queued = self.queued, None
        if queued is None or not scheduled:
            return None
        handle, positions = queued
        row = {id(s.seq): (i, pos) for i, (s, pos) in enumerate(zip(handle.sampled, positions))}
        keep = []
        for s in scheduled:
            hit = row.get(id(s.seq))
            if s.num_new_tokens != 1 or hit is None or hit[1] != s.seq.num_computed_tokens:
                if self.pinned:  # its sequences' states moved on a token this schedule does not compute
                    raise RuntimeError("a decode step queued ahead of a model with recurrent state was discarded")
                return None
            keep.append(hit[0])
        self.overlapped_steps += 1
        return handle.select(keep)

    def launch(self, handle, scheduled: list[ScheduledSequence]) -> None:
        """Queue the decode step after `handle` when it is likely to be the next step."""
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        if not handle.sampled or len(handle.sampled) != len(scheduled) or not decode_only:
            return  # only decode steps, where every sequence sampled
        if len(scheduled) == 1 and self.speculator.may_draft_next(scheduled[0].seq):
            return  # the next step may speculate, which needs this step's token to look up drafts
        keep, leaving = [], []
        for i, s in enumerate(handle.sampled):
            seq, p = s.seq, s.seq.params
            if seq.generator is not None or p.logprobs is not None:
                return  # a seeded draw or logprobs must not be spent on a step that may be dropped
            out_after = seq.num_output_tokens + 1
            if (p.max_tokens is not None and out_after >= p.max_tokens) or seq.num_tokens + 1 >= self.max_model_len:
                leaving.append(seq)  # finishes with this step's token
                continue
            if not self.block_manager.can_allocate(seq, 1):
                return  # the scheduler will preempt
            self.block_manager.allocate(seq, 1)
            keep.append(i)
        # asked once the step's blocks are taken, as the next schedule takes them before admitting: a request
        # waiting for blocks it cannot get yet does not cost every step its overlap
        if not keep or self.scheduler.admits_next(leaving):
            return
        prev = handle.select(keep)
        step = self.runner.launch([ScheduledSequence(s.seq, 1) for s in prev.sampled], next_tokens=prev.token_ids)
        self.queued = step, [s.seq.num_computed_tokens for s in prev.sampled]
