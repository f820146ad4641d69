"""Piecewise CUDA graphs: a forward captured as graphs between its prefill-attention launches.

Decode steps and single-sequence prefills replay whole-step graphs (model_runner). Every other step (several
sequences prefilling, a prefill chunk next to decodes, a speculative check of several sequences) ran eagerly,
host-bound on the Python and launch cost of each kernel: ~85 ms per step for Qwen3-30B-A3B's 48 MoE layers
whatever its token count (bench/RESULTS.md, twenty-fifth session). Of a forward's launches only the prefill
attention's grid and tiling depend on how the step's tokens split into sequences; everything else depends on
the token count alone. So the forward is captured per token-count bucket in pieces cut at that launch
(vLLM's "piecewise" graphs), and a replay is, per layer, one graph replay and one attention launch that takes
the step's host lengths.

A replay must touch the memory the capture touched: the pieces read the runner's static inputs (tokens,
positions, slots), their activations live in the graph pool, and each cut passes through two static buffers,
the rotated queries the piece before writes and the attention output the piece after reads.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from radiance.engine.step_graphs import StagingSets, by_group, copy_tables, with_groups
from radiance.layers.attention import Attention, AttentionMetadata


@dataclass(frozen=True)
class _Cut:
    attn: Attention
    sinks: torch.Tensor | None


class PiecewiseCapture:
    """Handed to every Attention as `attn.cut` while one bucket's forward is captured: at each prefill
    attention it ends the piece being captured, runs the launch eagerly into the static output and begins
    the next piece."""

    def __init__(self, q_buffer: torch.Tensor, out_buffer: torch.Tensor, pool):
        self.q_buffer = q_buffer  # [tokens, Hq, D]
        self.out_buffer = out_buffer
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[_Cut] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        graph, self._graph = self._graph, None
        graph.capture_end()
        self.graphs.append(graph)
        if self.pool is None:
            self.pool = graph.pool()

    def abort(self) -> None:
        """End a capture left open by an error (the stream cannot be used while it captures)."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            graph.capture_end()

    def rotated_q(self, q: torch.Tensor) -> torch.Tensor:
        """The static tensor the rotary launch writes the rotated q [T, Hq, D] into."""
        static = self.q_buffer[:q.shape[0]]
        if static.shape != q.shape or static.dtype != q.dtype:
            raise ValueError(f"piecewise capture: queries {tuple(q.shape)} {q.dtype} do not fit the static "
                             f"buffer {tuple(self.q_buffer.shape)} {self.q_buffer.dtype}")
        return static

    def __call__(self, attn: Attention, q: torch.Tensor, meta: AttentionMetadata,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        static_q = self.rotated_q(q)
        if q.data_ptr() != static_q.data_ptr():  # q rotated elsewhere (no fused rotary): copied in this piece
            static_q.copy_(q)
        self.end()
        out = self.out_buffer[:q.shape[0]]
        attn.prefill_attention(static_q, meta, sinks, out=out)  # eager, so the next piece sees real values
        self.cuts.append(_Cut(attn, sinks))
        self.begin()
        return out


@dataclass
class PiecewiseForward:
    """One bucket's forward: len(cuts) + 1 graphs with an attention launch between each two."""

    graphs: list[torch.cuda.CUDAGraph]
    cuts: list[_Cut]
    q: torch.Tensor  # the static buffers of the cuts ([tokens, Hq, D])
    out: torch.Tensor
    hidden: torch.Tensor  # the last piece's output [tokens, hidden]

    def replay(self, meta: AttentionMetadata) -> torch.Tensor:
        """The forward over the runner's static inputs (filled for this step); `meta` holds the step's
        sequences (host lengths, device lengths and block tables for them) and the static slot mapping."""
        for graph, cut in zip(self.graphs, self.cuts):
            graph.replay()
            group = cut.attn.kv_group
            cut.attn.prefill_attention(self.q, meta.of_group(group) if group else meta, cut.sinks, out=self.out)
        self.graphs[-1].replay()
        return self.hidden


def capture_piecewise(model, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      q_buffer: torch.Tensor, out_buffer: torch.Tensor, pool=None) -> PiecewiseForward:
    """Capture model(tokens, positions, meta) (a non-decode step of len(tokens) tokens over the paged cache)
    in pieces; `pool` is a graph memory pool to share (None: a new one, PiecewiseForward.graphs[0].pool())."""
    size = tokens.shape[0]
    capture = PiecewiseCapture(q_buffer[:size], out_buffer[:size], pool)
    layers = model.attention_layers()
    stream = torch.cuda.Stream(device=tokens.device)
    stream.wait_stream(torch.cuda.current_stream(tokens.device))
    for attn in layers:
        attn.cut = capture
    try:
        with torch.cuda.stream(stream), torch.inference_mode():
            capture.begin()
            hidden = model(tokens, positions, meta)
            capture.end()
    except BaseException:
        capture.abort()
        raise
    finally:
        for attn in layers:
            attn.cut = None
    torch.cuda.current_stream(tokens.device).wait_stream(stream)
    if len(capture.cuts) != len(layers):
        raise RuntimeError(f"piecewise capture: {len(capture.cuts)} attention cuts in a forward of {len(layers)} "
                           "layers (a layer whose attention does not run the Triton prefill path)")
    return PiecewiseForward(capture.graphs, capture.cuts, q_buffer[:size], out_buffer[:size], hidden)


class PiecewiseGraphs:
    """A runner's piecewise forwards, one per token bucket, for steps of up to `max_seqs` sequences, and the
    static inputs they read: [tokens, positions, slots] of the largest bucket; int32 [cu_seqlens_q (max_seqs
    + 1), context_lens (max_seqs), the step's real rows]; the block tables. Padding rows write no KV (slot -1),
    lie outside cu_seqlens_q (attention never computes them) and route to no expert (valid_rows). Filled from
    step_graphs.StagingSets, as the whole-step graphs are: the engine may queue steps ahead."""

    def __init__(self, sizes: list[int], max_seqs: int, max_blocks_per_seq: int, q_shape: tuple[int, int],
                 dtype: torch.dtype, device: torch.device, kv_groups: int = 1):
        self.sizes, self.max_seqs = sorted(sizes), max_seqs
        self.forwards: dict[int, PiecewiseForward] = {}
        top = self.sizes[-1]
        self.meta = torch.zeros(2 + kv_groups, top, dtype=torch.long, device=device)  # tokens, positions, slots
        self.lens = torch.zeros(2 * max_seqs + 2, dtype=torch.int32, device=device)
        self.tables = torch.zeros(kv_groups, max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.table_stage = torch.zeros(self.tables.numel(), dtype=torch.int32, device=device) if kv_groups > 1 else None
        self.meta[2:].fill_(-1)
        self.staging = StagingSets([(tuple(t.shape), t.dtype) for t in (self.meta, self.lens, self.tables)], device)
        # the cuts' static buffers: rotated queries in, attention output out (zeroed: padding rows stay finite)
        self.q_buffer = torch.zeros(top, *q_shape, dtype=dtype, device=device)
        self.out_buffer = torch.zeros(top, *q_shape, dtype=dtype, device=device)

    def capture(self, model, pool=None):
        """Capture every bucket, largest first, sharing `pool`; returns the pool (for the next captures)."""
        tokens, positions = self.meta[:2].unbind(0)
        for size in reversed(self.sizes):
            self.lens[:2].copy_(torch.tensor([0, size], dtype=torch.int32))
            self.lens[self.max_seqs + 1] = self.lens[-1] = size
            meta = self.step_meta(size, [size], [size])
            with torch.inference_mode():
                model(tokens[:size], positions[:size], meta)  # warm-up: Triton compiles, scratch at full size
            torch.cuda.synchronize(tokens.device)
            self.forwards[size] = capture_piecewise(model, tokens[:size], positions[:size], meta, self.q_buffer,
                                                    self.out_buffer, pool)
            pool = self.forwards[size].graphs[0].pool()
        return pool

    def serves(self, rows: int, batch: int) -> bool:
        return bool(self.forwards) and rows <= self.sizes[-1] and batch <= self.max_seqs

    def step_meta(self, size: int, q_lens: list[int], kv_lens: list[int]) -> AttentionMetadata:
        """The metadata of a step of len(q_lens) sequences in bucket `size`: views of the static inputs."""
        batch, first_len = len(q_lens), self.max_seqs + 1
        meta = AttentionMetadata(slot_mapping=self.meta[2, :size], block_tables=self.tables[0, :batch],
                                 context_lens=self.lens[first_len:first_len + batch],
                                 cu_seqlens_q=self.lens[:batch + 1], q_lens=q_lens, kv_lens=kv_lens,
                                 is_decode=False, valid_rows=self.lens[-1:])
        return with_groups(meta, self.meta[2:, :size], self.tables[:, :batch])

    def replay(self, tokens, positions, slots, q_lens: list[int], kv_lens: list[int], tables) -> torch.Tensor:
        """Hidden states of the step's rows: tokens, positions, slots (host, one per row), q_lens / kv_lens per
        sequence, tables [batch, width] its block tables."""
        rows, batch, first_len = len(positions), len(q_lens), self.max_seqs + 1
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        slots, tables = by_group(slots, tables)
        h_meta, h_lens, h_tables = self.staging.next()
        meta = h_meta.numpy()
        meta[:2, :rows] = (tokens, positions)
        meta[2:, :rows] = slots
        meta[:2, rows:size] = 0
        meta[2:, rows:size] = -1  # padding rows: write nowhere
        lens = h_lens.numpy()
        lens[0] = 0
        lens[1:batch + 1] = np.cumsum(q_lens)
        lens[first_len:first_len + batch] = kv_lens
        lens[-1] = rows
        self.meta[:, :size].copy_(h_meta[:, :size], non_blocking=True)
        self.lens.copy_(h_lens, non_blocking=True)
        copy_tables(self.tables, h_tables, self.table_stage, tables)
        return self.forwards[size].replay(self.step_meta(size, q_lens, kv_lens))[:rows]
