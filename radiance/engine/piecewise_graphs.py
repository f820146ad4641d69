"""Piecewise CUDA graphs: a forward captured as graphs between its launches that depend on the step's sequences.

Decode steps and single-sequence prefills replay whole-step graphs (model_runner). Every other step (several
sequences prefilling, a prefill chunk next to decodes, a speculative check of several sequences) ran eagerly,
host-bound on the Python and launch cost of each kernel: ~85 ms per step for Qwen3-30B-A3B's 48 MoE layers
whatever its token count (bench/RESULTS.md, twenty-fifth session). Of a forward's launches only the prefill
attention's grid and tiling depend on how the step's tokens split into sequences (and, in a hybrid model's
linear-attention layers, the conv's and the delta rule's); everything else depends on the token count alone. So the
forward is captured per token-count bucket in pieces cut at those launches (vLLM's "piecewise" graphs), and a
replay is, per layer, one graph replay and the layer's eager launches that take the step's host lengths.

A replay must touch the memory the capture touched: the pieces read the runner's static inputs (tokens,
positions, slots), their activations live in the graph pool, and each cut passes through static buffers: at an
attention, the rotated queries the piece before writes and the attention output the piece after reads; at a
linear-attention layer, the conv's inputs and the gates in, the delta rule's output out (DeltaRuleBuffers). A
hybrid model's single-sequence prefills replay these graphs too (no whole-step graph runs its delta rule).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from radiance.engine.state_cache import StepStates
from radiance.engine.step_graphs import StagingSets, by_group, copy_tables, with_groups
from radiance.layers.attention import Attention, AttentionMetadata


@dataclass(frozen=True)
class _AttentionCut:
    """A prefill-attention launch between two pieces: the static rotated queries in, the static output out."""

    attn: Attention
    sinks: torch.Tensor | None
    q: torch.Tensor
    out: torch.Tensor

    def run(self, meta: AttentionMetadata) -> None:
        group = self.attn.kv_group
        self.attn.prefill_attention(self.q, meta.of_group(group) if group else meta, self.sinks, out=self.out)


class DeltaRuleBuffers(NamedTuple):
    """The static buffers of a linear-attention cut (every such layer and bucket shares them): the conv's inputs
    [tokens, conv channels] and the gates g, beta [tokens, value heads] float32 in, the delta rule's output [tokens,
    value heads, value_head_dim] out."""

    qkv: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out: torch.Tensor

    @classmethod
    def allocate(cls, tokens: int, la, dtype: torch.dtype, device: torch.device) -> DeltaRuleBuffers:
        """For `la` (models.arch_config.LinearAttentionConfig); the output zeroed, so padding rows stay finite."""
        gate = torch.zeros(tokens, la.num_value_heads, dtype=torch.float32, device=device)
        return cls(torch.zeros(tokens, la.conv_channels, dtype=dtype, device=device), gate, gate.clone(),
                   torch.zeros(tokens, la.num_value_heads, la.value_head_dim, dtype=dtype, device=device))

    def rows(self, n: int) -> DeltaRuleBuffers:
        return DeltaRuleBuffers(*(t[:n] for t in self))


@dataclass(frozen=True)
class _DeltaRuleCut:
    """A linear-attention layer's conv and delta rule between two pieces (GatedDeltaNet.prefill_delta_rule)."""

    layer: torch.nn.Module
    buffers: DeltaRuleBuffers

    def run(self, meta: AttentionMetadata) -> None:
        qkv, g, beta, out = self.buffers
        self.layer.prefill_delta_rule(qkv, g, beta, meta, out=out)


class PiecewiseCapture:
    """Handed to every Attention and linear-attention layer as `.cut` while one bucket's forward is captured: at each
    prefill attention (and conv with delta rule) it ends the piece being captured, runs the launches eagerly into the
    static output and begins the next piece. `delta`: the bucket's rows of the linear-attention buffers (None: a
    model without such layers)."""

    def __init__(self, q_buffer: torch.Tensor, out_buffer: torch.Tensor, pool, delta: DeltaRuleBuffers | None = None):
        self.q_buffer = q_buffer  # [tokens, Hq, D]
        self.out_buffer = out_buffer
        self.delta = delta
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[_AttentionCut | _DeltaRuleCut] = []
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
        self.cuts.append(_AttentionCut(attn, sinks, static_q, out))
        self.begin()
        return out

    def delta_rule(self, layer, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """A linear-attention layer's cut: the piece copies the conv's inputs and the gates into the static buffers
        and ends; the conv and the delta rule run eagerly into the static output, which the next piece reads."""
        if self.delta is None:
            raise RuntimeError("piecewise capture: a linear-attention layer in a forward captured without its buffers")
        for name, value, static in zip(("qkv", "g", "beta"), (qkv, g, beta), self.delta):
            if static.shape != value.shape or static.dtype != value.dtype:
                raise ValueError(f"piecewise capture: {name} {tuple(value.shape)} {value.dtype} does not fit the "
                                 f"static buffer {tuple(static.shape)} {static.dtype}")
            static.copy_(value)
        self.end()
        cut = _DeltaRuleCut(layer, self.delta)
        cut.run(meta)  # eager, so the next piece sees real values
        self.cuts.append(cut)
        self.begin()
        return self.delta.out


@dataclass
class PiecewiseForward:
    """One bucket's forward: len(cuts) + 1 graphs with a cut's eager launches between each two."""

    graphs: list[torch.cuda.CUDAGraph]
    cuts: list[_AttentionCut | _DeltaRuleCut]
    hidden: torch.Tensor  # the last piece's output [tokens, hidden]

    def replay(self, meta: AttentionMetadata) -> torch.Tensor:
        """The forward over the runner's static inputs (filled for this step); `meta` holds the step's
        sequences (host lengths, device lengths and block tables for them, their state slots) and the static slot
        mapping."""
        for graph, cut in zip(self.graphs, self.cuts):
            graph.replay()
            cut.run(meta)
        self.graphs[-1].replay()
        return self.hidden


def capture_piecewise(model, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      q_buffer: torch.Tensor, out_buffer: torch.Tensor, pool=None,
                      delta: DeltaRuleBuffers | None = None) -> PiecewiseForward:
    """Capture model(tokens, positions, meta) (a non-decode step of len(tokens) tokens over the paged cache)
    in pieces; `pool` is a graph memory pool to share (None: a new one, PiecewiseForward.graphs[0].pool());
    `delta`: the linear-attention buffers of a hybrid model."""
    size = tokens.shape[0]
    capture = PiecewiseCapture(q_buffer[:size], out_buffer[:size], pool, delta.rows(size) if delta else None)
    layers = model.attention_layers() + getattr(model, "linear_attention_layers", list)()
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
        raise RuntimeError(f"piecewise capture: {len(capture.cuts)} cuts in a forward of {len(layers)} attention "
                           "layers (a layer whose attention does not run the Triton prefill path)")
    return PiecewiseForward(capture.graphs, capture.cuts, hidden)


class PiecewiseGraphs:
    """A runner's piecewise forwards, one per token bucket, for steps of up to `max_seqs` sequences, and the
    static inputs they read: int64 [tokens, positions, the slots of each KV group] of the largest bucket, then with
    `linear_attention` each sequence's state slot; int32 [cu_seqlens_q (max_seqs + 1), context_lens (max_seqs),
    with linear_attention whether each sequence continues its state (max_seqs), the step's real rows]; the block
    tables. Padding rows write no KV (slot -1), lie outside cu_seqlens_q (attention, the conv and the delta rule
    never compute them) and route to no expert (valid_rows). Filled from step_graphs.StagingSets, as the
    whole-step graphs are: the engine may queue steps ahead. `linear_attention`: a hybrid model's
    LinearAttentionConfig (the shapes of its cuts' static buffers)."""

    def __init__(self, sizes: list[int], max_seqs: int, max_blocks_per_seq: int, q_shape: tuple[int, int],
                 dtype: torch.dtype, device: torch.device, kv_groups: int = 1, linear_attention=None):
        self.sizes, self.max_seqs, self.kv_groups = sorted(sizes), max_seqs, kv_groups
        self.forwards: dict[int, PiecewiseForward] = {}
        top, states = self.sizes[-1], linear_attention is not None
        self.meta = torch.zeros(2 + kv_groups + int(states), top, dtype=torch.long, device=device)
        self.lens = torch.zeros((3 if states else 2) * max_seqs + 2, dtype=torch.int32, device=device)
        self.tables = torch.zeros(kv_groups, max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.table_stage = torch.zeros(self.tables.numel(), dtype=torch.int32, device=device) if kv_groups > 1 else None
        self.meta[2:].fill_(-1)
        self.staging = StagingSets([(tuple(t.shape), t.dtype) for t in (self.meta, self.lens, self.tables)], device)
        # the cuts' static buffers: rotated queries in, attention output out (zeroed: padding rows stay finite)
        self.q_buffer = torch.zeros(top, *q_shape, dtype=dtype, device=device)
        self.out_buffer = torch.zeros(top, *q_shape, dtype=dtype, device=device)
        self.state_slots = self.meta[2 + kv_groups] if states else None
        self._continues_at = 2 * max_seqs + 1  # where the lens hold the continue flags
        self.continues = self.lens[self._continues_at:self._continues_at + max_seqs] if states else None
        self.delta = DeltaRuleBuffers.allocate(top, linear_attention, dtype, device) if states else None

    def capture(self, model, pool=None):
        """Capture every bucket, largest first, sharing `pool`; returns the pool (for the next captures)."""
        tokens, positions = self.meta[:2].unbind(0)
        # a hybrid model's captures run the delta rule for real, as one sequence starting in state slot 0 (free
        # while the engine starts; a sequence's slot is zeroed as it is taken)
        states = StepStates([0], [False], ()) if self.delta is not None else None
        for size in reversed(self.sizes):
            self.lens[:2].copy_(torch.tensor([0, size], dtype=torch.int32))
            self.lens[self.max_seqs + 1] = self.lens[-1] = size
            if states is not None:
                self.state_slots[0], self.continues[0] = 0, 0
            meta = self.step_meta(size, [size], [size], states)
            with torch.inference_mode():
                model(tokens[:size], positions[:size], meta)  # warm-up: Triton compiles, scratch at full size
            torch.cuda.synchronize(tokens.device)
            self.forwards[size] = capture_piecewise(model, tokens[:size], positions[:size], meta, self.q_buffer,
                                                    self.out_buffer, pool, self.delta)
            pool = self.forwards[size].graphs[0].pool()
        return pool

    def serves(self, rows: int, batch: int) -> bool:
        return bool(self.forwards) and rows <= self.sizes[-1] and batch <= self.max_seqs

    def step_meta(self, size: int, q_lens: list[int], kv_lens: list[int],
                  states: StepStates | None = None) -> AttentionMetadata:
        """The metadata of a step of len(q_lens) sequences in bucket `size`: views of the static inputs (and a
        hybrid model's `states`: their host flags and saves, the chunk table of the delta rule)."""
        batch, first_len = len(q_lens), self.max_seqs + 1
        meta = AttentionMetadata(slot_mapping=self.meta[2, :size], block_tables=self.tables[0, :batch],
                                 context_lens=self.lens[first_len:first_len + batch],
                                 cu_seqlens_q=self.lens[:batch + 1], q_lens=q_lens, kv_lens=kv_lens,
                                 is_decode=False, valid_rows=self.lens[-1:])
        if self.state_slots is not None:
            meta.state_slots, meta.continues_state_device = self.state_slots[:batch], self.continues[:batch]
            meta.continues_state, meta.state_saves = states.continues, states.saves
            meta.delta_chunks = states.chunk_table(q_lens, self.meta.device)
        return with_groups(meta, self.meta[2:2 + self.kv_groups, :size], self.tables[:, :batch])

    def replay(self, tokens, positions, slots, q_lens: list[int], kv_lens: list[int], tables,
               states: StepStates | None = None) -> torch.Tensor:
        """Hidden states of the step's rows: tokens, positions, slots (host, one per row), q_lens / kv_lens per
        sequence, tables [batch, width] its block tables; `states`: a hybrid model's (required there)."""
        rows, batch, first_len = len(positions), len(q_lens), self.max_seqs + 1
        if (states is None) != (self.state_slots is None):
            raise ValueError("piecewise replay: a hybrid model's step needs its StepStates (and only such a step)")
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        slots, tables = by_group(slots, tables)
        h_meta, h_lens, h_tables = self.staging.next()
        meta = h_meta.numpy()
        meta[:2, :rows] = (tokens, positions)
        meta[2:2 + self.kv_groups, :rows] = slots
        meta[:2, rows:size] = 0
        meta[2:, rows:size] = -1  # padding rows: write nowhere
        lens = h_lens.numpy()
        lens[0] = 0
        lens[1:batch + 1] = np.cumsum(q_lens)
        lens[first_len:first_len + batch] = kv_lens
        lens[-1] = rows
        if states is not None:
            meta[2 + self.kv_groups, :batch] = states.slots
            lens[self._continues_at:self._continues_at + batch] = states.continues
        self.meta[:, :size].copy_(h_meta[:, :size], non_blocking=True)
        self.lens.copy_(h_lens, non_blocking=True)
        copy_tables(self.tables, h_tables, self.table_stage, tables)
        return self.forwards[size].replay(self.step_meta(size, q_lens, kv_lens, states))[:rows]
