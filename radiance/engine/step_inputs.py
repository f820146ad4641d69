"""The host side of a step's inputs: tokens, positions, cache slots and block tables of the scheduled sequences, as
numpy arrays the runner copies to the device (eagerly, or into a CUDA graph's static inputs)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from radiance.engine.scheduler import ScheduledSequence


class BlockTableMirror:
    """numpy copies of the sequences' block tables (one per KV group), extended as the tables grow, so a step
    copies arrays instead of converting every sequence's whole Python list (at batch 64 and 8k context that
    conversion took ~2 ms of host time per step). Sound because the block manager only appends to a table,
    releases its leading entries in place (counted by Sequence.released_blocks), or gives the sequence a new
    list when it frees its blocks or takes cached ones (the identity check catches that)."""

    def __init__(self):
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def row(self, seq, group: int = 0) -> np.ndarray:
        table = seq.block_table if group == 0 else seq.group_tables[group - 1]
        counts = getattr(seq, "released_blocks", None) or ()
        released = counts[group] if group < len(counts) else 0
        entries = self._rows.setdefault(seq, {})
        entry = entries.get(group)
        if entry is None or entry[0] is not table or len(entry[1]) > len(table):
            array = np.asarray(table, dtype=np.int32)
        else:
            _, array, seen = entry
            if len(array) == len(table) and released <= seen:
                return array
            if len(array) < len(table):
                array = np.concatenate((array, np.asarray(table[len(array):], dtype=np.int32)))
            elif released > seen:
                array = array.copy()  # a step may still hold the array it was given
            if released > seen:
                array[seen:released] = table[seen:released]
        entries[group] = (table, array, released)
        return array


class StepInputs:
    """Builds a step's inputs for a cache of `block_size`-token blocks in `num_groups` KV groups (engine.kv_layout)."""

    def __init__(self, block_size: int, num_groups: int, device: torch.device):
        self.block_size = block_size
        self.num_groups = num_groups
        self.device = device
        self.mirror = BlockTableMirror()

    def prepare(self, scheduled: list[ScheduledSequence], tokens_on_device: bool = False):
        """Host-side inputs of a step; with tokens_on_device the tokens are not known here (empty list). Slots
        [groups, tokens] and tables [groups, sequences, blocks]: one row per KV group (KvLayout)."""
        bs, groups = self.block_size, self.num_groups
        rows = [[self.mirror.row(s.seq, g) for s in scheduled] for g in range(groups)]
        tables = np.zeros((groups, len(scheduled), max(len(r) for r in rows[0])), dtype=np.int32)
        for g, group_rows in enumerate(rows):
            for i, row in enumerate(group_rows):
                tables[g, i, :len(row)] = row
        if all(s.num_new_tokens == 1 for s in scheduled):  # decode: one lookup per sequence and group
            starts = [s.seq.num_computed_tokens for s in scheduled]
            tokens = [] if tokens_on_device else [s.seq.token_ids[p] for s, p in zip(scheduled, starts)]
            slots = np.array([[s.seq.kv_table(g)[p // bs] * bs + p % bs for s, p in zip(scheduled, starts)]
                              for g in range(groups)], dtype=np.int64)
            return (tokens, np.array(starts, dtype=np.int64), slots, [1] * len(starts), [p + 1 for p in starts],
                    tables)
        tokens, positions, q_lens, kv_lens = [], [], [], []
        slots: list[list[np.ndarray]] = [[] for _ in range(groups)]
        for i, s in enumerate(scheduled):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            if not tokens_on_device:
                tokens.extend(seq.token_ids[start:start + n])
            pos = np.arange(start, start + n)
            positions.append(pos)
            for g in range(groups):
                slots[g].append(rows[g][i][pos // bs].astype(np.int64) * bs + pos % bs)
            q_lens.append(n)
            kv_lens.append(start + n)
        return (tokens, np.concatenate(positions), np.stack([np.concatenate(g) for g in slots]), q_lens, kv_lens,
                tables)

    def first_blocks_in_order(self, tables: np.ndarray, kv_lens: list[int]) -> list[int] | None:
        """AttentionMetadata.kv_first_blocks for the torch attention (CPU): per sequence the first block of
        its context when the blocks run in order (b, b + 1, ...), else -1; None on CUDA (paged kernels)."""
        if self.device.type != "cpu":
            return None
        first = []
        for row, kv_len in zip(tables, kv_lens):
            blocks = row[:-(-kv_len // self.block_size)]
            in_order = len(blocks) > 0 and bool(np.all(blocks - blocks[0] == np.arange(len(blocks))))
            first.append(int(blocks[0]) if in_order else -1)
        return first
