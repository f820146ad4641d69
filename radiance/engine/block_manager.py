"""Paged KV cache bookkeeping: which cache blocks each sequence owns, plus prefix caching.

A full block is identified by a digest of (the previous block's digest, its token ids), so equal prefixes
map to equal digest chains. Freed blocks keep their contents and hash until they are handed out again (LRU
order), so a later request with the same prefix reuses them without recomputing.

With `prefer_in_order` (the CPU engine), a growing sequence takes the block right after its last one
when that block is free and holds no cached prefix, ahead of LRU order: its blocks then run in order, and the
CPU attention reads the cache in place instead of gathering the context every step
(AttentionMetadata.kv_first_blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from radiance.engine.sequence import Sequence


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
                 prefer_in_order: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefer_in_order = prefer_in_order
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.tokens_of_block: list[tuple[int, ...] | None] = [None] * num_blocks  # guards against hash collisions
        self.block_of_hash: dict[bytes, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefix cache

    def cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, hash) of the longest cached prefix of a sequence without blocks, looked up without taking
        anything. At least one token is left to compute (its logits start generation)."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], salt_digest(seq)
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(parent, tokens)
            block = self.block_of_hash.get(parent)
            if block is None or self.tokens_of_block[block] != tokens:
                break
            found.append((block, parent))
        return found

    def match_prefix(self, seq: Sequence) -> int:
        """On admission of a sequence without blocks: take the cached blocks of its longest cached prefix.
        Returns tokens reused."""
        assert not seq.block_table
        for block, h in self.cached_prefix(seq):
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full since the last call in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else salt_digest(seq), tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.block_of_hash:
                self.block_of_hash[h] = block
                self.hash_of_block[block] = h
                self.tokens_of_block[block] = tokens
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ---------------------------------------------------------------- allocation

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to hold its computed tokens and `num_new_tokens` more."""
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.new_blocks_needed(seq, num_new_tokens)):
            following = seq.block_table[-1] + 1 if self.prefer_in_order and seq.block_table else None
            seq.block_table.append(self._take_fresh_block(following))

    def _take_fresh_block(self, wanted: int | None = None) -> int:
        """`wanted` when it is free and caches nothing, else the least recently freed block. A cached block is not
        taken out of turn: after a prompt sharing a system prompt with another, the block after the shared one is
        the other prompt's cached continuation, and taking it evicted that while hundreds of blocks were unused."""
        if wanted is not None and wanted in self.free_blocks and self.hash_of_block[wanted] is None:
            del self.free_blocks[wanted]
            block = wanted
        else:
            block, _ = self.free_blocks.popitem(last=False)
        h = self.hash_of_block[block]
        if h is not None:
            if self.block_of_hash.get(h) == block:
                del self.block_of_hash[h]
            self.hash_of_block[block] = None
            self.tokens_of_block[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        # tail blocks first: they are the least likely to be shared, so they are evicted first
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
