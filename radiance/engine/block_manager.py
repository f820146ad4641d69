"""Paged KV cache bookkeeping: which cache blocks each sequence owns, plus prefix caching.

A full block is identified by a digest of (the previous block's digest, its token ids), so equal prefixes
map to equal digest chains. Freed blocks keep their contents and hash until they are handed out again (LRU
order), so a later request with the same prefix reuses them without recomputing.

With local layers (engine.kv_layout), each KV group has its own block table, all drawn from this one pool; a local
group's blocks behind its span are released as the sequence grows (table entries -> `null_block`), and a prefix hit
needs, in each local group, the cached blocks of the span behind the hit. A group's cached block is keyed by its
digest and the group.

A model with recurrent state (Qwen3.5's linear attention) also needs the states at the end of a prefix: a hit is cut
back to the last block whose states the prefix cache kept (state_cache.PrefixStates), and admission copies them into
the sequence's slot.

With `prefer_in_order` (the CPU engine), a growing sequence takes the block right after its last one
when that block is free and holds no cached prefix, ahead of LRU order: its blocks then run in order, and the
CPU attention reads the cache in place instead of gathering the context every step
(AttentionMetadata.kv_first_blocks). A local group's blocks, which never run in order, come from the other end of
the free list, where its released blocks go, so that they do not take the full groups' next blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from radiance.engine.kv_layout import KvLayout
from radiance.engine.sequence import Sequence
from radiance.engine.state_cache import StateSlots
from radiance.kernels._triton.gated_delta_chunked import CHUNK


def block_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """SHA-256 of the previous block's digest and this block's tokens, so it stands for the whole prefix. Not
    Python's hash(): for ints and tuples it is 64 bits, computed the same way in every process and invertible
    step by step, so a crafted prompt could collide with another request's prefix and be served its K/V."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


def salt_digest(seq: Sequence) -> bytes | None:
    """The parent digest of a sequence's first block: None, or one derived from its SamplingParams.cache_salt
    (vLLM's), so salted requests share cached blocks only with requests of the same salt, and from its LoRA
    adapter's fingerprint, so blocks written under one adapter serve neither another nor the base."""
    salt = seq.params.cache_salt
    digest = None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    lora = seq.lora_fingerprint
    if lora is not None:
        digest = hashlib.sha256(b"lora\0" + lora + (digest or b"")).digest()
    return digest


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefer_in_order: bool = False, layout: KvLayout | None = None, state_slots: StateSlots | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefer_in_order = prefer_in_order
        self.layout = layout or KvLayout.single(1)
        self.num_groups = self.layout.num_groups
        # where a released entry points: the cache's extra zeroed block, never handed out (None: nothing released)
        self.null_block = num_blocks if self.layout.releases_pages else None
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks  # its key in block_of_hash (digest + group)
        self.tokens_of_block: list[tuple[int, ...] | None] = [None] * num_blocks  # guards against hash collisions
        self.block_of_hash: dict[bytes, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # a hybrid model's linear-attention states: a sequence holds a slot while it holds blocks
        self.state_slots = state_slots
        # and its prefix cache needs, besides the KV blocks of a prefix, the states at the prefix's end
        self.prefix_states = state_slots.prefix if state_slots is not None and enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The block table of each KV group (a sequence's first call gives it the other groups' empty tables)."""
        if len(seq.group_tables) != self.num_groups - 1:
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        return [seq.block_table, *seq.group_tables]

    def live_blocks(self, seq: Sequence) -> list[int]:
        """Every block `seq` holds a reference to, each group's table in turn (released entries left out)."""
        return [b for table in self.tables(seq) for b in table if b != self.null_block]

    @staticmethod
    def _key(digest: bytes, group: int) -> bytes:
        return digest if group == 0 else digest + bytes([group])

    def _first_kept(self, group: int, num_computed: int) -> int:
        """The first block of `group` a step starting at token `num_computed` reads."""
        return self.layout.first_kept_block(group, num_computed, self.block_size)

    # ---------------------------------------------------------------- prefix cache

    def cached_prefix(self, seq: Sequence) -> tuple[list[list[int]], list[bytes]]:
        """(each group's table, the digests) of the longest cached prefix of a sequence without blocks, looked up
        without taking anything: every full-attention group's blocks, and in a local group those its span reaches
        behind the prefix's end (null_block for the rest). At least one token is left to compute (its logits
        start generation)."""
        if not self.enable_prefix_caching:
            return [[] for _ in range(self.num_groups)], []
        found: list[list[int | None]] = [[] for _ in range(self.num_groups)]
        digests, parent = [], salt_digest(seq)
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, tokens)
            hits = [self._cached(parent, g, tokens) for g in range(self.num_groups)]
            if any(hit is None and span is None for hit, span in zip(hits, self.layout.spans)):
                break
            digests.append(parent)
            for g, hit in enumerate(hits):
                found[g].append(hit)
        while digests and not (self._span_cached(found, len(digests)) and self._states_cached(digests)):
            digests.pop()
            for table in found:
                table.pop()
        return [self._with_released(g, table) for g, table in enumerate(found)], digests

    def _cached(self, digest: bytes, group: int, tokens: tuple[int, ...]) -> int | None:
        block = self.block_of_hash.get(self._key(digest, group))
        return block if block is not None and self.tokens_of_block[block] == tokens else None

    def _span_cached(self, found: list[list[int | None]], num_blocks: int) -> bool:
        """Whether each local group has the blocks its span reads behind a prefix of `num_blocks` blocks."""
        position = num_blocks * self.block_size
        return all(None not in found[g][self._first_kept(g, position):num_blocks]
                   for g in range(self.num_groups) if self.layout.spans[g] is not None)

    def _states_cached(self, digests: list[bytes]) -> bool:
        """Whether a model with recurrent state has the states at the end of the prefix (always, without one)."""
        return self.state_slots is None or (self.prefix_states is not None and digests[-1] in self.prefix_states)

    def _with_released(self, group: int, table: list[int | None]) -> list[int]:
        first = self._first_kept(group, len(table) * self.block_size)
        return [self.null_block] * first + table[first:]

    def match_prefix(self, seq: Sequence) -> int:
        """On admission of a sequence without blocks: take the cached blocks of its longest cached prefix.
        Returns tokens reused."""
        assert not seq.block_table
        tables, digests = self.cached_prefix(seq)
        for table in tables:
            for block in table:
                if block == self.null_block:
                    continue
                if self.ref_counts[block] == 0:
                    del self.free_blocks[block]
                self.ref_counts[block] += 1
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        seq.block_hashes = digests
        seq.num_hashed_blocks = len(digests)
        seq.num_computed_tokens = len(digests) * self.block_size
        seq.released_blocks = [table.count(self.null_block) if self.null_block is not None else 0 for table in tables]
        if digests and self.prefix_states is not None:  # the states the prefix left, in the sequence's own slot
            seq.state_slot = self.state_slots.take(zeroed=False)
            self.prefix_states.restore(digests[-1], seq.state_slot)
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full since the last call in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        tables = self.tables(seq)
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else salt_digest(seq), tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(tables):
                block, key = table[i], self._key(h, g)
                if block != self.null_block and key not in self.block_of_hash:  # released before it was full
                    self.block_of_hash[key] = block
                    self.hash_of_block[block] = key
                    self.tokens_of_block[block] = tokens
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
        if seq.state_save is not None:  # written by the step's launches
            _, digest, row = seq.state_save
            seq.state_save = None
            self.prefix_states.publish(digest, row)
        if self.prefix_states is not None and seq.state_slot >= 0 and seq.num_computed_tokens == full * self.block_size:
            self._save_states(seq, full)

    def _plan_state_save(self, seq: Sequence, num_new_tokens: int) -> None:
        """A prompt's last chunk keeps its states from inside the step at its last whole 64-token chunk of the
        delta rule that ends on a block boundary before the final token (Sequence.state_save; model_runner passes
        it on as AttentionMetadata.state_saves): a chunk cut there would give the last tokens a step of their own,
        an eager forward (~30 ms of host time for Qwen3.5-9B on an H100)."""
        start = seq.num_computed_tokens
        if start + num_new_tokens != seq.num_tokens or start % self.block_size:
            return
        grid = max(CHUNK, self.block_size)  # both powers of two: a whole number of chunks ending on a boundary
        tokens = (num_new_tokens - 1) // grid * grid
        if tokens <= 0:
            return
        digest = self._digest_of_prefix(seq, (start + tokens) // self.block_size)
        if not self.prefix_states.touch(digest):
            row = self.prefix_states.reserve()
            seq.state_save = None if row is None else (tokens, digest, row)

    def _digest_of_prefix(self, seq: Sequence, num_blocks: int) -> bytes:
        """The digest of the sequence's first `num_blocks` blocks (past its committed ones, from its tokens)."""
        if num_blocks <= len(seq.block_hashes):
            return seq.block_hashes[num_blocks - 1]
        parent = seq.block_hashes[-1] if seq.block_hashes else salt_digest(seq)
        for i in range(len(seq.block_hashes), num_blocks):
            parent = block_hash(parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
        return parent

    def _save_states(self, seq: Sequence, full: int) -> None:
        """Keep a hybrid model's states where a prefill chunk ended on a block boundary (the scheduler cuts chunks
        there). Only a chunk short of the sequence's last token: saving at decode boundaries too would copy each
        sequence's states every block_size tokens (48 MiB for Qwen3.5-9B) for answers a later prompt rarely
        repeats whole. The engine commits a step right after queuing it, before queuing any other, so the copy
        lands behind the step that computed the states on the device's stream."""
        if 0 < seq.num_computed_tokens < seq.num_tokens:
            self.prefix_states.save(seq.state_slot, seq.block_hashes[full - 1])

    # ---------------------------------------------------------------- allocation

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to hold its computed tokens and `num_new_tokens` more, less those its local groups
        give back first (see blocks_to_take)."""
        return self.blocks_to_take(self.tables(seq), seq.num_computed_tokens, num_new_tokens,
                                   released=seq.released_blocks)

    def blocks_to_take(self, tables: list[list[int]], num_computed: int, num_new_tokens: int,
                       refs: dict[int, int] | None = None, released: list[int] | None = None) -> int:
        """Free blocks a step of `num_new_tokens` after `num_computed` takes from a sequence holding `tables`: the
        new blocks of every group, less the blocks its local groups release behind their span that no other
        sequence holds (reference counts from `refs` where it has them). `released`: how many leading entries of
        each table are released already (Sequence.released_blocks), so a long context's are not walked again."""
        new = (self.blocks_needed(num_computed + num_new_tokens) - len(tables[0])) * self.num_groups
        if self.null_block is None:
            return new
        refs = refs or {}
        for g, table in enumerate(tables):
            start = released[g] if released else 0
            for block in table[start:self._first_kept(g, num_computed)]:
                if block != self.null_block and refs.get(block, self.ref_counts[block]) == 1:
                    new -= 1
        return new

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if self.state_slots is not None and seq.state_slot < 0:
            seq.state_slot = self.state_slots.take()
        if self.prefix_states is not None:
            self._plan_state_save(seq, num_new_tokens)
        if self.null_block is not None:
            self._release_behind_spans(seq)
        wanted = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for g, table in enumerate(self.tables(seq)):
            local = self.layout.spans[g] is not None
            for _ in range(wanted):
                if not self.prefer_in_order:
                    table.append(self._take_fresh_block())
                elif local:  # its blocks never run in order: from the free list's end, where its releases go, so
                    table.append(self._take_fresh_block(from_end=True))  # it leaves the full groups their runs
                else:
                    table.append(self._take_fresh_block(table[-1] + 1 if table else None))

    def _release_behind_spans(self, seq: Sequence) -> None:
        """Give back each local group's blocks that no step from token seq.num_computed_tokens on reads: null_block
        in their place, in the table itself, and Sequence.released_blocks counts them (step_inputs.BlockTableMirror
        follows that count; copying a long context's table at each release cost milliseconds per step)."""
        tables = self.tables(seq)
        released = seq.released_blocks or [0] * len(tables)
        for g, table in enumerate(tables):
            first = min(self._first_kept(g, seq.num_computed_tokens), len(table))
            for i in range(released[g], first):
                self._drop(table[i])
                table[i] = self.null_block
            released[g] = max(released[g], first)
        seq.released_blocks = released

    def _take_fresh_block(self, wanted: int | None = None, from_end: bool = False) -> int:
        """`wanted` when it is free and caches nothing, else the least recently freed block (the most recently freed
        one `from_end`). A cached block is not taken out of turn: after a prompt sharing a system prompt with
        another, the block after the shared one is the other prompt's cached continuation, and taking it evicted
        that while hundreds of blocks were unused."""
        if wanted is not None and wanted in self.free_blocks and self.hash_of_block[wanted] is None:
            del self.free_blocks[wanted]
            block = wanted
        else:
            block, _ = self.free_blocks.popitem(last=from_end)
        h = self.hash_of_block[block]
        if h is not None:
            if self.block_of_hash.get(h) == block:
                del self.block_of_hash[h]
            self.hash_of_block[block] = None
            self.tokens_of_block[block] = None
        self.ref_counts[block] = 1
        return block

    def _drop(self, block: int) -> None:
        if block == self.null_block:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def free(self, seq: Sequence) -> None:
        # tail blocks first: they are the least likely to be shared, so they are evicted first
        tables = self.tables(seq)
        for i in reversed(range(len(seq.block_table))):
            for table in tables:
                self._drop(table[i])
        seq.block_table = []
        seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        seq.released_blocks = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0:
            self.state_slots.give_back(seq.state_slot)
            seq.state_slot = -1
        if seq.state_save is not None:  # freed between its schedule and its step
            self.prefix_states.release(seq.state_save[2])
            seq.state_save = None
