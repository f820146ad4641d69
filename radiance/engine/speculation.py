"""N-gram speculative decoding (SpeculativeConfig). A lone decoding sequence may get n-gram drafts appended to
its tokens; the scheduler then computes them with its last token in one step, each position samples as a plain
decode would, and the drafts are kept up to the first one that differs from what was sampled before it (then
that sample follows). Text that does not repeat itself is looked up less and less often."""

from __future__ import annotations

from typing import Callable

from radiance.config import EngineConfig
from radiance.engine.block_manager import BlockManager
from radiance.engine.ngram import may_find_drafts, propose_ngram_drafts
from radiance.engine.scheduler import Scheduler
from radiance.engine.sequence import Sequence

MAX_DRAFT_BACKOFF = 16  # plain decode steps at most between draft lookups of a sequence whose drafts miss


class NgramSpeculator:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int):
        self.spec = config.speculative
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.draft_tokens = 0  # drafts proposed
        self.accepted_draft_tokens = 0  # ... and kept

    def applies_to(self, seq: Sequence) -> bool:
        """Whether a decoding sequence may get drafts (not rows whose outputs depend on one draw or one set of
        counts per step)."""
        p = seq.params
        return bool(self.spec.ngram_draft_tokens) and seq.generator is None and p.logprobs is None and not p.adjusts_logits

    def may_draft_next(self, seq: Sequence) -> bool:
        """Whether the next step of this lone sequence may speculate: its lookup needs this step's token, so
        the step must not be queued ahead (overlap.DecodeAhead)."""
        return self.applies_to(seq) and not seq.draft_backoff and may_find_drafts(seq.token_ids, self.spec.ngram_min)

    def propose(self) -> None:
        """Append drafts to the one running sequence, when it is alone and decoding, before the schedule."""
        if not self.spec.ngram_draft_tokens or len(self.scheduler.running) != 1 or self.scheduler.waiting:
            return
        seq = self.scheduler.running[0]
        if seq.num_computed_tokens != seq.num_tokens - 1 or not self.applies_to(seq):
            return
        if seq.draft_backoff:
            seq.draft_backoff -= 1
            return
        p = seq.params
        room = min(self.spec.ngram_draft_tokens, self.max_model_len - seq.num_tokens - 1,
                   self.max_num_batched_tokens - 1)  # one step computes them all
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        drafts = propose_ngram_drafts(seq.token_ids, room, self.spec.ngram_max, self.spec.ngram_min)
        if not drafts and room > 0:
            self.missed(seq)  # this step gave up the overlap for nothing
        if drafts and self.block_manager.can_allocate(seq, 1 + len(drafts)):
            seq.token_ids.extend(drafts)
            seq.num_draft_tokens = len(drafts)
            self.draft_tokens += len(drafts)

    @staticmethod
    def missed(seq: Sequence) -> None:
        """A lookup found nothing or its drafts were all refused: text that does not repeat itself is looked
        up less often (1, 2, 4 .. MAX_DRAFT_BACKOFF plain, overlapped steps after each miss in a row)."""
        seq.draft_misses += 1
        seq.draft_backoff = min(1 << (seq.draft_misses - 1), MAX_DRAFT_BACKOFF)

    def verify(self, seq: Sequence, sampled: list[int], append: Callable[[Sequence, int, None], None]) -> None:
        """Keeps the drafts that match what was sampled at the position before each, then the first sample
        that differs (or the one after the last draft), each through `append` (the engine's, which applies
        the stops); K/V past the kept tokens is rewritten later."""
        drafts = seq.token_ids[-seq.num_draft_tokens:]
        del seq.token_ids[-seq.num_draft_tokens:]
        seq.num_draft_tokens = 0
        kept = 0
        while kept < len(drafts) and sampled[kept] == drafts[kept]:
            kept += 1
        self.accepted_draft_tokens += kept
        if kept:
            seq.draft_misses = 0
        else:
            self.missed(seq)
        seq.num_computed_tokens -= len(drafts) - kept
        for token in sampled[:kept + 1]:
            append(seq, token, None)
            if seq.is_finished:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.block_manager.commit(seq)
