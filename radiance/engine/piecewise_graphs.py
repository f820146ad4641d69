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

from dataclasses import dataclass

import torch

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

    tokens: int
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
            cut.attn.prefill_attention(self.q, meta, cut.sinks, out=self.out)
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
    return PiecewiseForward(size, capture.graphs, capture.cuts, q_buffer[:size], out_buffer[:size], hidden)
