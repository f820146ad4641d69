"""Continuous batching: each step picks which sequences advance and by how many tokens.

Running sequences go first (a decode is one token, an unfinished prefill its next chunk), then waiting
ones are admitted while the token budget (`max_num_batched_tokens`), `max_num_seqs` and free KV blocks
allow. When a running sequence needs a block and none is free, the most recently arrived running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its tokens (prompt + output so far) when it is admitted again.

Against preemption churn (a sequence preempted, re-admitted with the blocks it just gave back, preempted
again before it samples, its recompute lost each time): beside running sequences, a waiting sequence is
admitted only when its blocks leave a watermark of free blocks (as vLLM's) for the running ones to grow
into, and a preempted one only when the blocks of its whole recompute do. So a sequence preempted in a
step is not re-admitted in it either: the blocks it freed, less those the grower took, are too few.

A model with recurrent state and prefix caching has its prefill chunks short of a prompt's end cut on block
boundaries, where the prefix cache keeps its states (`_ending_on_a_block`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from radiance.config import SchedulerConfig
from radiance.engine.block_manager import BlockManager
from radiance.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

WATERMARK_FRACTION = 0.01  # of the cache's blocks kept free when admitting beside running sequences (vLLM's)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, whose logits give the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora=None):
        self.config = config
        self.block_manager = block_manager
        self.lora = lora  # radiance.lora.LoraManager: at most max_loras adapters per step, slots at admission
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # vLLM's prefix-cache counters: prompt tokens looked up at a request's first admission, and those found
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.watermark_blocks = max(1, int(WATERMARK_FRACTION * block_manager.num_blocks))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens) to free KV blocks", seq.request_id, seq.num_tokens)

    def _chunk(self, seq: Sequence, num_computed: int, budget: int, nothing_scheduled: bool) -> int:
        """Tokens `seq` computes next, from `num_computed` on, within `budget`."""
        remaining = seq.num_tokens - num_computed
        if self.config.enable_chunked_prefill:
            n = min(remaining, budget)
        elif remaining <= budget or nothing_scheduled:  # unchunked: a prefill goes whole; one larger than the budget
            n = remaining                                # runs alone rather than never
        else:
            return 0
        return self._ending_on_a_block(seq, num_computed, n) if self.block_manager.prefix_states is not None else n

    def _ending_on_a_block(self, seq: Sequence, num_computed: int, n: int) -> int:
        """A hybrid model's chunk short of the sequence's end cut at the last block boundary it reaches, where the
        prefix cache keeps its states (state_cache.PrefixStates; the last chunk keeps them from inside its step).
        A chunk that reaches no boundary stays whole."""
        end, size = num_computed + n, self.block_manager.block_size
        if end >= seq.num_tokens:
            return n
        boundary = end // size * size
        return boundary - num_computed if boundary > num_computed else n

    def _can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._fits(seq, self.block_manager.tables(seq), seq.num_computed_tokens, num_new_tokens,
                          self.block_manager.num_free_blocks, beside_running=bool(self.running))

    def _fits(self, seq: Sequence, tables: list[list[int]], num_computed: int, num_new_tokens: int, num_free: int,
              beside_running: bool, refs: dict[int, int] | None = None) -> bool:
        """Whether a waiting sequence holding `tables` (one per KV group; `num_computed` tokens) may start with
        `num_new_tokens` while `num_free` blocks are free. Alone it needs just their blocks. Beside running
        sequences it leaves the watermark free too, and a preempted one waits until its whole recompute
        fits: admitted with less, it would be the next victim as soon as they grow (in steps of the token budget,
        its local KV groups holding their span and a step's blocks at most)."""
        bm = self.block_manager
        if beside_running and seq.admitted:
            whole = bm.layout.pages_for(seq.num_tokens, bm.block_size, self.config.max_num_batched_tokens)
            needed = whole - sum(b != bm.null_block for table in tables for b in table)
        else:
            needed = bm.blocks_to_take(tables, num_computed, num_new_tokens, refs)
        return needed + (self.watermark_blocks if beside_running else 0) <= num_free

    def admits_next(self, leaving: list[Sequence] | tuple[Sequence, ...] = ()) -> bool:
        """Whether the next schedule() admits the head of the queue, when every running sequence but those
        `leaving` (finished by then) decodes one token in it, into blocks it already holds: the engine asks
        before queuing a decode step ahead, which such an admission would discard. Same rule as schedule(),
        without its side effects (the cached prefix blocks it would take are only looked up). A sequence
        that stops on a token in between is not foreseen: then a step queued ahead may be discarded."""
        staying = len(self.running) - len(leaving)
        budget = self.config.max_num_batched_tokens - staying
        if not self.waiting or staying >= self.config.max_num_seqs or budget <= 0:
            return False
        bm = self.block_manager
        freed = self._refs_after(leaving)
        num_free = bm.num_free_blocks + sum(1 for b, refs in freed.items() if refs == 0)
        seq = self.waiting[0]
        tables, num_computed = bm.tables(seq), seq.num_computed_tokens
        if not seq.block_table and seq.params.prompt_logprobs is None:  # as schedule() matches it
            tables, digests = bm.cached_prefix(seq)
            num_computed = len(digests) * bm.block_size
            num_free -= sum(1 for table in tables for b in table  # taken off the free list
                            if b != bm.null_block and freed.get(b, bm.ref_counts[b]) == 0)
        n = self._chunk(seq, num_computed, budget, nothing_scheduled=staying == 0)
        return n > 0 and self._fits(seq, tables, num_computed, n, num_free, beside_running=staying > 0, refs=freed)

    def _refs_after(self, leaving) -> dict[int, int]:
        """Each block the `leaving` sequences hold: its reference count once they have freed it."""
        refs: dict[int, int] = {}
        for seq in leaving:
            for block in self.block_manager.live_blocks(seq):
                refs[block] = refs.get(block, self.block_manager.ref_counts[block]) - 1
        return refs

    def schedule(self, admit: bool = True) -> list[ScheduledSequence]:
        """This step's sequences: the running ones (preempting from the back when blocks run out), then, with
        `admit`, waiting ones while the token budget, max_num_seqs and the blocks allow."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_computed_tokens, budget, not scheduled)
            if n == 0:
                i += 1
                continue
            while not bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            bm.allocate(seq, n)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            i += 1

        # LoRA: a sequence whose adapter would exceed max_loras in this step waits (skipped, keeping its place)
        active = self.lora.step_adapters(self.running) if self.lora is not None else None
        skipped: list[Sequence] = []
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if active is not None and not self.lora.admits(seq, active):
                skipped.append(self.waiting.popleft())
                continue
            cached = None
            if not seq.block_table and seq.params.prompt_logprobs is None:  # those score every prompt token
                cached = bm.match_prefix(seq)
            n = self._chunk(seq, seq.num_computed_tokens, budget, not scheduled)
            if n == 0 or not self._can_admit(seq, n):
                if not scheduled and not self.running and not bm.can_allocate(seq, n):
                    raise RuntimeError(f"request {seq.request_id} needs more KV blocks than the cache holds")
                bm.free(seq)  # do not hoard matched prefix blocks while waiting
                break
            bm.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if cached is not None and not seq.admitted:  # set once admitted: one aborted while waiting used none
                seq.num_cached_tokens = cached
            if not seq.admitted and bm.enable_prefix_caching and seq.params.prompt_logprobs is None:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_cached_tokens
            seq.admitted = True
            if active is not None:
                self.lora.activate(seq, active)
                if seq.lora_int_id:
                    active.add(seq.lora_int_id)
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return scheduled
