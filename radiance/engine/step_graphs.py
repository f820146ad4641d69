"""Whole-step CUDA graphs: decode steps of up to `cuda_graph_max_batch` sequences (one graph per batch bucket), and
prefills of one sequence (one per token bucket). Steps neither serves replay the piecewise graphs
(piecewise_graphs.py) or run eagerly (model_runner.py).

Each family's graphs read static device inputs, which a replay fills from a pinned host staging set with one
transfer per input. Three sets are used in turn: the engine queues up to two steps ahead of the one it last waited
for, and a set must not be rewritten while its copy still waits in the stream. A bucket's padding rows write no KV
(slot -1), attend to nothing and are routed to no expert (AttentionMetadata.valid_rows: the real row count, on the
device).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import torch

from radiance.layers.attention import AttentionMetadata

STAGING_SETS = 3
_TARGET_DECODE_CTAS = 264  # ~2 waves of an H100/H200's 132 SMs


class StagingSets:
    """STAGING_SETS pinned host copies (pinned on CUDA only) of a graph family's static inputs, handed out in turn."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        pin = device.type == "cuda"
        self._sets = [tuple(torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in shapes)
                      for _ in range(STAGING_SETS)]
        self._turn = 0

    def next(self) -> tuple[torch.Tensor, ...]:
        """The set to fill for this step: not the last two steps' sets, whose copies may still wait in the stream."""
        self._turn = (self._turn + 1) % STAGING_SETS
        return self._sets[self._turn]


def decode_num_splits(batch: int, num_kv_heads: int) -> int:
    """KV partitions per sequence for the split-KV decode kernel: enough CTAs to fill the GPU."""
    return max(1, min(32, -(-_TARGET_DECODE_CTAS // (batch * num_kv_heads))))


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch buckets up to max_batch: 1, 2, 4, 8, then every 16, and max_batch itself."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 16))
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


def by_group(slots, tables) -> tuple[np.ndarray, np.ndarray]:
    """A step's host slots as [groups, tokens] and tables as [groups, sequences, blocks], whether given so
    (step_inputs.StepInputs.prepare) or for one KV group ([tokens], [sequences, blocks])."""
    slots = np.asarray(slots)
    return slots.reshape(-1, slots.shape[-1]), tables.reshape((-1,) + tables.shape[-2:])


def with_groups(meta: AttentionMetadata, slots: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
    """`meta` (group 0's: slots[0], tables[0]) with the metadata of KV groups 1, 2, ...: the other rows of the
    static slots [groups, tokens] and tables [groups, sequences, blocks]."""
    meta.other_groups = tuple(dataclasses.replace(meta, slot_mapping=slots[g], block_tables=tables[g])
                              for g in range(1, slots.shape[0]))
    return meta


def copy_tables(device_tables: torch.Tensor, host_tables: torch.Tensor, stage: torch.Tensor | None,
                tables: np.ndarray) -> None:
    """Queue the step's block tables [groups, rows, width] into the static `device_tables` [groups, max rows, max
    width] through the pinned `host_tables` (its shape). One KV group: the rows' whole width in one copy (entries
    past a row's blocks are never read). Several: `device_tables[:, :rows]` is not one contiguous range, and a
    copy into it from the host would go through a pageable temporary, synchronously; nor would the whole width
    be cheap (7 groups x 64 rows x 8192 blocks of a 128k context are 14.7 MB a step): the rows' width goes over
    contiguous into the device `stage` (as many elements) and is spread on the device."""
    groups, rows, width = tables.shape
    if groups == 1:
        host_tables.numpy()[0, :rows, :width] = tables[0]
        device_tables[:, :rows].copy_(host_tables[:, :rows], non_blocking=True)
        return
    n = groups * rows * width
    flat = host_tables.view(-1)[:n]
    flat.numpy()[:] = tables.reshape(-1)
    stage[:n].copy_(flat, non_blocking=True)
    device_tables[:, :rows, :width].copy_(stage[:n].view(groups, rows, width))


def capture_forward(model, pool, tokens: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of one forward over static inputs, in memory `pool` (shared by a family's buckets:
    captured largest first, each reuses what the larger one freed)."""
    with torch.inference_mode():
        model(tokens, positions, meta)  # warm-up outside the capture: Triton compiles, scratch buffers at full size
        torch.cuda.synchronize(tokens.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            out = model(tokens, positions, meta)
    return graph, out


class DecodeGraphs:
    """One graph per decode batch bucket. Static inputs: one int64 block [tokens, positions, context lens, the batch
    (column 0: the real rows), then the slots of each KV group, then with `state_slots` each sequence's slot of a
    hybrid model's linear-attention states (engine.state_cache)] and the block tables [groups, batch, blocks]."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, num_kv_heads: int, device: torch.device,
                 kv_groups: int = 1, state_slots: bool = False):
        self.buckets = graph_buckets(max_batch)
        self.num_kv_heads = num_kv_heads
        self.kv_groups = kv_groups
        self.meta = torch.zeros(4 + kv_groups + int(state_slots), max_batch, dtype=torch.long, device=device)
        self.tables = torch.zeros(kv_groups, max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.table_stage = torch.zeros(self.tables.numel(), dtype=torch.int32, device=device) if kv_groups > 1 else None
        self.staging = StagingSets([(tuple(t.shape), t.dtype) for t in (self.meta, self.tables)], device)
        self.tokens, self.positions, self.context, self.batch_row = self.meta[:4].unbind(0)
        self.slots = self.meta[4:4 + kv_groups]
        self.state_slots = self.meta[4 + kv_groups] if state_slots else None
        # a padding row: token 0 at position 0, writes nowhere (no KV, no state), attends to nothing
        self._padding = np.array([0, 0, 0, 0] + [-1] * (kv_groups + int(state_slots)), dtype=np.int64)[:, None]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def capture(self, model, pool=None):
        """(Re)capture every bucket, largest first, in `pool` (None: a new one; a re-capture picks up changed kernel
        tilings); returns the pool."""
        self.meta[4:].fill_(-1)  # the warm-ups and captures write no KV and no state
        self.context.fill_(1)
        for batch in reversed(self.buckets):
            self.batch_row[0] = batch
            meta = with_groups(AttentionMetadata(
                slot_mapping=self.slots[0, :batch], block_tables=self.tables[0, :batch],
                context_lens=self.context[:batch], cu_seqlens_q=None, q_lens=[1] * batch,
                kv_lens=[1] * batch, is_decode=True, decode_splits=decode_num_splits(batch, self.num_kv_heads),
                valid_rows=self.batch_row[:1],
                state_slots=self.state_slots[:batch] if self.state_slots is not None else None),
                self.slots[:, :batch], self.tables[:, :batch])
            self.graphs[batch], self.hidden[batch] = capture_forward(model, pool, self.tokens[:batch],
                                                                     self.positions[:batch], meta)
            pool = self.graphs[batch].pool()
        return pool

    def serves(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.buckets[-1]

    def replay(self, tokens, positions, slots, kv_lens, tables, state_slots=None) -> torch.Tensor:
        """The hidden states [batch, H] of a decode step. tokens: host ints, or a device tensor (a step queued
        behind the one that samples them); state_slots: host ints, with the graphs' state slots."""
        batch = len(positions)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        slots, tables = by_group(slots, tables)
        h_meta, h_tables = self.staging.next()
        meta = h_meta.numpy()
        meta[:, batch:bucket] = self._padding
        meta[3, 0] = batch
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            meta[0, :batch] = tokens
        meta[1, :batch] = positions
        meta[2, :batch] = kv_lens
        meta[4:4 + self.kv_groups, :batch] = slots
        if self.state_slots is not None:
            meta[4 + self.kv_groups, :batch] = state_slots
        self.meta[:, :bucket].copy_(h_meta[:, :bucket], non_blocking=True)
        copy_tables(self.tables, h_tables, self.table_stage, tables)
        if on_device:
            self.tokens[:batch].copy_(tokens)
        self.graphs[bucket].replay()
        return self.hidden[bucket][:batch]


class PrefillGraphs:
    """One graph per token bucket for steps that prefill (a chunk of) one sequence. Static inputs: [tokens,
    positions, slots] of the largest bucket, int32 [cu_seqlens_q (0, q_len), context_len] and the sequence's
    block table. Padding rows lie outside cu_seqlens: attention never computes them; the caller keeps the
    first q_len rows of the output."""

    def __init__(self, sizes: list[int], max_blocks_per_seq: int, device: torch.device, kv_groups: int = 1):
        self.sizes = sorted(sizes)
        self.meta = torch.zeros(2 + kv_groups, self.sizes[-1], dtype=torch.long, device=device)  # slots per group
        self.lens = torch.zeros(3, dtype=torch.int32, device=device)
        self.table = torch.zeros(kv_groups, 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.table_stage = torch.zeros(self.table.numel(), dtype=torch.int32, device=device) if kv_groups > 1 else None
        self.staging = StagingSets([(tuple(t.shape), t.dtype) for t in (self.meta, self.lens, self.table)], device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def capture(self, model, pool=None):
        """Capture every bucket, largest first, in `pool` (None: a new one); returns the pool."""
        tokens, positions = self.meta[:2].unbind(0)
        slots = self.meta[2:]
        slots.fill_(-1)
        for size in reversed(self.sizes):
            self.lens.copy_(torch.tensor([0, size, size], dtype=torch.int32))
            meta = with_groups(AttentionMetadata(slot_mapping=slots[0, :size], block_tables=self.table[0],
                                                 context_lens=self.lens[2:], cu_seqlens_q=self.lens[:2],
                                                 q_lens=[size], kv_lens=[size], is_decode=False,
                                                 valid_rows=self.lens[1:2]), slots[:, :size], self.table)
            self.graphs[size], self.hidden[size] = capture_forward(model, pool, tokens[:size], positions[:size], meta)
            pool = self.graphs[size].pool()
        return pool

    def serves(self, q_len: int) -> bool:
        return bool(self.graphs) and q_len <= self.sizes[-1]

    def replay(self, tokens, positions, slots, kv_len: int, tables) -> torch.Tensor:
        """The hidden states [q_len, H] of the step's one sequence (context kv_len with its new tokens)."""
        q_len = len(positions)
        size = self.sizes[bisect.bisect_left(self.sizes, q_len)]
        h_meta, h_lens, h_table = self.staging.next()
        slots, tables = by_group(slots, tables)
        meta = h_meta.numpy()
        meta[:2, :q_len] = (tokens, positions)
        meta[2:, :q_len] = slots
        meta[:2, q_len:size] = 0
        meta[2:, q_len:size] = -1  # padding rows: write nowhere
        h_lens.numpy()[:] = (0, q_len, kv_len)
        self.meta[:, :size].copy_(h_meta[:, :size], non_blocking=True)
        self.lens.copy_(h_lens, non_blocking=True)
        copy_tables(self.table, h_table, self.table_stage, tables[:, :1])
        self.graphs[size].replay()
        return self.hidden[size][:q_len]
