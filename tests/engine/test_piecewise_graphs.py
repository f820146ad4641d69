"""The piecewise capture's protocol on the CPU, with stand-ins for CUDA graphs and the attention launch (the real
thing, captured and replayed on a GPU against eager steps: test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radiance.engine import piecewise_graphs as pw
from radiance.engine.state_cache import StepStates
from radiance.layers.attention import AttentionMetadata, StateSave

# a hybrid model's linear-attention shapes (models.arch_config.LinearAttentionConfig's fields the buffers read)
LINEAR = SimpleNamespace(conv_channels=6, num_value_heads=2, value_head_dim=2)


class FakeGraph:
    """Records its capture and replays into a shared log."""

    log: list = []
    made = 0

    def __init__(self):
        self.name = f"graph{FakeGraph.made}"
        FakeGraph.made += 1

    def capture_begin(self, pool=None):
        FakeGraph.log.append(("begin", self.name, pool))

    def capture_end(self):
        FakeGraph.log.append(("end", self.name))

    def pool(self):
        return "pool-of-" + self.name

    def replay(self):
        FakeGraph.log.append(("replay", self.name))


class FakeAttention:
    """Stands for Attention: prefill_attention writes q + its layer index into `out`."""

    def __init__(self, index: int, kv_group: int = 0):
        self.index, self.kv_group = index, kv_group

    def prefill_attention(self, q, meta, sinks=None, out=None):
        FakeGraph.log.append(("attention", self.index, meta, sinks))
        out.copy_(q + self.index)
        return out


class FakeDeltaLayer:
    """Stands for GatedDeltaNet: prefill_delta_rule writes qkv's first four columns times g's first column, plus
    beta's and its index, into `out`."""

    def __init__(self, index: int):
        self.index = index

    def prefill_delta_rule(self, qkv, g, beta, meta, out=None):
        FakeGraph.log.append(("delta", self.index, meta))
        out.copy_((qkv[:, :4] * g[:, :1] + beta[:, :1] + self.index).reshape(out.shape))
        return out


@pytest.fixture
def fake_graphs(monkeypatch):
    FakeGraph.log, FakeGraph.made = [], 0
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    return FakeGraph.log


def test_each_cut_ends_a_piece_runs_the_launch_and_begins_the_next(fake_graphs):
    q_buffer, out_buffer = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    capture = pw.PiecewiseCapture(q_buffer[:6], out_buffer[:6], pool=None)
    layers = [FakeAttention(1), FakeAttention(2)]
    capture.begin()
    q = torch.randn(6, 2, 4)
    out = capture(layers[0], q, "meta", None)  # q rotated elsewhere: copied into the static buffer
    assert out.data_ptr() == out_buffer.data_ptr() and torch.equal(q_buffer[:6], q) and torch.equal(out, q + 1)
    static_q = capture.rotated_q(q)
    static_q.copy_(q * 2)  # what the rotary launch does when it writes into the static buffer itself
    capture(layers[1], static_q, "meta", "sinks")
    capture.end()
    assert [e[:2] for e in fake_graphs] == [("begin", "graph0"), ("end", "graph0"), ("attention", 1),
                                            ("begin", "graph1"), ("end", "graph1"), ("attention", 2),
                                            ("begin", "graph2"), ("end", "graph2")]
    # the first piece makes the pool the later ones share
    assert [e[2] for e in fake_graphs if e[0] == "begin"] == [None, "pool-of-graph0", "pool-of-graph0"]
    assert [c.attn for c in capture.cuts] == layers and capture.cuts[1].sinks == "sinks"

    forward = pw.PiecewiseForward(capture.graphs, capture.cuts, torch.zeros(6, 3))
    fake_graphs.clear()
    forward.replay("step-meta")
    assert [e[:2] for e in fake_graphs] == [("replay", "graph0"), ("attention", 1), ("replay", "graph1"),
                                            ("attention", 2), ("replay", "graph2")]
    assert all(e[2] == "step-meta" for e in fake_graphs if e[0] == "attention")


def test_a_cut_of_another_kv_group_runs_with_that_groups_metadata(fake_graphs):
    """A local layer of KV group 1 (engine.kv_layout) reads its group's tables and slots at replay."""
    capture = pw.PiecewiseCapture(torch.zeros(4, 2, 4), torch.zeros(4, 2, 4), pool=None)
    layers = [FakeAttention(1), FakeAttention(2, kv_group=1)]
    capture.begin()
    for attn in layers:
        capture(attn, torch.zeros(4, 2, 4), "meta", None)
    capture.end()
    forward = pw.PiecewiseForward(capture.graphs, capture.cuts, torch.zeros(4, 3))
    group_1 = AttentionMetadata(torch.zeros(4), torch.zeros(1, 2), None, None, [4], [4], False)
    step = AttentionMetadata(torch.zeros(4), torch.zeros(1, 2), None, None, [4], [4], False, other_groups=(group_1,))
    fake_graphs.clear()
    forward.replay(step)
    assert [e[2] for e in fake_graphs if e[0] == "attention"] == [step, group_1]


def test_a_linear_attention_cut_runs_the_conv_and_delta_rule_between_pieces(fake_graphs):
    """At a linear-attention layer the piece copies the conv's inputs and the gates into the static buffers and
    ends; the layer's prefill_delta_rule runs eagerly from them into the static output, which the layer goes on
    with; a replay runs it again, with the step's metadata, on what the piece before wrote."""
    buffers = pw.DeltaRuleBuffers.allocate(8, LINEAR, torch.float32, torch.device("cpu"))
    assert [tuple(t.shape) for t in buffers] == [(8, 6), (8, 2), (8, 2), (8, 2, 2)]
    capture = pw.PiecewiseCapture(torch.zeros(5, 1, 2), torch.zeros(5, 1, 2), pool=None, delta=buffers.rows(5))
    layers = [FakeDeltaLayer(1), FakeAttention(2)]
    qkv, g, beta = torch.randn(5, 6), torch.randn(5, 2), torch.randn(5, 2)
    capture.begin()
    out = capture.delta_rule(layers[0], qkv, g, beta, "meta")
    capture(layers[1], torch.zeros(5, 1, 2), "meta", None)
    capture.end()
    assert out.data_ptr() == buffers.out.data_ptr() and out.shape == (5, 2, 2)
    assert torch.equal(buffers.qkv[:5], qkv) and torch.equal(buffers.g[:5], g) and torch.equal(buffers.beta[:5], beta)
    assert torch.equal(out, (qkv[:, :4] * g[:, :1] + beta[:, :1] + 1).reshape(5, 2, 2))
    assert [e[:2] for e in fake_graphs] == [("begin", "graph0"), ("end", "graph0"), ("delta", 1),
                                            ("begin", "graph1"), ("end", "graph1"), ("attention", 2),
                                            ("begin", "graph2"), ("end", "graph2")]
    forward = pw.PiecewiseForward(capture.graphs, capture.cuts, torch.zeros(5, 3))
    fake_graphs.clear()
    buffers.qkv.zero_()  # as the first piece's replay writes this step's conv inputs
    forward.replay("step-meta")
    assert [e[:3] for e in fake_graphs] == [("replay", "graph0"), ("delta", 1, "step-meta"), ("replay", "graph1"),
                                            ("attention", 2, "step-meta"), ("replay", "graph2")]
    assert torch.equal(out, (beta[:, :1] + 1).expand(5, 4).reshape(5, 2, 2))


def test_a_linear_attention_cut_refuses_what_its_buffers_do_not_hold(fake_graphs):
    capture = pw.PiecewiseCapture(torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), pool=None,
                                  delta=pw.DeltaRuleBuffers.allocate(4, LINEAR, torch.float32, torch.device("cpu")))
    layer, gate = FakeDeltaLayer(0), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="qkv"):
        capture.delta_rule(layer, torch.zeros(4, 7), gate, gate, "meta")
    with pytest.raises(ValueError, match="beta"):
        capture.delta_rule(layer, torch.zeros(4, 6), gate, gate.half(), "meta")
    without = pw.PiecewiseCapture(torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), pool=None)
    with pytest.raises(RuntimeError, match="without its buffers"):
        without.delta_rule(layer, torch.zeros(4, 6), gate, gate, "meta")


def test_queries_that_do_not_fit_the_static_buffer_are_refused(fake_graphs):
    capture = pw.PiecewiseCapture(torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), pool=None)
    with pytest.raises(ValueError, match="static buffer"):
        capture.rotated_q(torch.zeros(8, 3, 4))
    with pytest.raises(ValueError, match="static buffer"):
        capture.rotated_q(torch.zeros(8, 2, 4, dtype=torch.float16))


def test_an_error_inside_a_piece_ends_its_capture(fake_graphs):
    capture = pw.PiecewiseCapture(torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), pool=None)
    capture.begin()
    capture.abort()
    capture.abort()  # nothing open any more: no second end
    assert [e[0] for e in fake_graphs] == ["begin", "end"] and capture.graphs == []


class FakeForward:
    """Stands for one bucket's captured forward: records the metadata it replays with."""

    def __init__(self, size: int):
        self.size, self.metas = size, []

    def replay(self, meta):
        self.metas.append(meta)
        return torch.arange(self.size, dtype=torch.float32)[:, None].expand(self.size, 3)


def test_a_step_fills_the_static_inputs_of_its_bucket():
    """Two sequences (3 and 4 new tokens) in the 8-token bucket: rows, padding (slot -1), cu_seqlens, context
    lengths, the real-row count and the block tables land where the captured pieces and the attention launch
    read them; the hidden rows of the step come back."""
    graphs = pw.PiecewiseGraphs([16, 8], max_seqs=3, max_blocks_per_seq=5, q_shape=(2, 4), dtype=torch.float32,
                                device=torch.device("cpu"))
    graphs.forwards = {8: FakeForward(8), 16: FakeForward(16)}
    assert graphs.sizes == [8, 16] and graphs.q_buffer.shape == graphs.out_buffer.shape == (16, 2, 4)
    assert graphs.serves(16, 3) and not graphs.serves(17, 1) and not graphs.serves(4, 4)
    tokens, positions = [11, 12, 13, 21, 22, 23, 24], np.array([5, 6, 7, 0, 1, 2, 3])
    slots = np.array([40, 41, 42, 8, 9, 10, 11])
    tables = np.array([[2, 3, 9], [1, 0, 0]], dtype=np.int32)
    hidden = graphs.replay(tokens, positions, slots, [3, 4], [8, 4], tables)
    assert hidden.shape == (7, 3) and graphs.forwards[16].metas == []
    assert graphs.meta[:, :8].tolist() == [tokens + [0], positions.tolist() + [0], slots.tolist() + [-1]]
    meta = graphs.forwards[8].metas[0]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 7] and meta.context_lens.tolist() == [8, 4]
    assert meta.valid_rows.tolist() == [7] and meta.q_lens == [3, 4] and meta.kv_lens == [8, 4]
    assert meta.block_tables.tolist() == [[2, 3, 9, 0, 0], [1, 0, 0, 0, 0]] and not meta.is_decode
    assert meta.slot_mapping.shape == (8,)
    # a smaller step next: the buffers' views follow it, the earlier step's tail stays padding to the bucket
    graphs.replay([5], np.array([8]), np.array([43]), [1], [9], tables[:1, :3])
    meta = graphs.forwards[8].metas[1]
    assert meta.cu_seqlens_q.tolist() == [0, 1] and meta.context_lens.tolist() == [9] and meta.valid_rows.tolist() == [1]
    assert graphs.meta[2, :8].tolist() == [43] + [-1] * 7


def test_a_step_of_two_kv_groups_fills_each_groups_slots_and_tables():
    graphs = pw.PiecewiseGraphs([8], max_seqs=2, max_blocks_per_seq=4, q_shape=(2, 4), dtype=torch.float32,
                                device=torch.device("cpu"), kv_groups=2)
    graphs.forwards = {8: FakeForward(8)}
    slots = np.array([[40, 41, 8], [72, 73, 24]])
    tables = np.array([[[2, 3, 9], [1, 0, 0]], [[4, 5, 6], [7, 0, 0]]], dtype=np.int32)
    graphs.replay([1, 2, 3], np.array([8, 9, 0]), slots, [2, 1], [10, 1], tables)
    meta = graphs.forwards[8].metas[0]
    (other,) = meta.other_groups
    assert meta.slot_mapping.tolist() == [40, 41, 8] + [-1] * 5 and other.slot_mapping.tolist() == [72, 73, 24] + [-1] * 5
    assert meta.block_tables[:, :3].tolist() == tables[0].tolist()
    assert other.block_tables[:, :3].tolist() == tables[1].tolist()
    assert other.cu_seqlens_q.tolist() == [0, 2, 3] and other.context_lens.tolist() == [10, 1]


def test_capture_takes_the_buckets_largest_first_and_threads_the_pool(monkeypatch):
    """Each bucket: a warm-up forward, then the capture, over the bucket's rows of the static inputs with one
    sequence filling it (cu_seqlens (0, size), context size, every row real); the pool of each capture is shared
    with the next (capture_piecewise itself stood in for: it needs a GPU)."""
    graphs = pw.PiecewiseGraphs([8, 16], max_seqs=2, max_blocks_per_seq=4, q_shape=(1, 2), dtype=torch.float32,
                                device=torch.device("cpu"))
    seen = []

    def model(tokens, positions, meta):
        seen.append(("warm-up", tokens.shape[0], meta.cu_seqlens_q.tolist(), meta.context_lens.tolist(),
                     meta.valid_rows.tolist()))

    def fake_capture(model_, tokens, positions, meta, q_buffer, out_buffer, pool, delta):
        seen.append(("capture", tokens.shape[0], pool, q_buffer is graphs.q_buffer))
        graph = FakeGraph()
        return pw.PiecewiseForward([graph], [], None)

    FakeGraph.log, FakeGraph.made = [], 0
    monkeypatch.setattr(pw, "capture_piecewise", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert graphs.capture(model, pool="start") == "pool-of-graph1"
    assert seen == [("warm-up", 16, [0, 16], [16], [16]), ("capture", 16, "start", True),
                    ("warm-up", 8, [0, 8], [8], [8]), ("capture", 8, "pool-of-graph0", True)]
    assert sorted(graphs.forwards) == [8, 16]


def test_a_hybrid_models_step_fills_its_state_slots_and_continue_flags():
    """A hybrid model's static inputs also hold each sequence's state slot and whether it continues its state; the
    step's metadata views them and carries the host flags, the prefix cache's saves and the delta rule's chunk
    table (none for short sequences without saves: the token-by-token kernel; always with a save)."""
    graphs = pw.PiecewiseGraphs([8, 16], max_seqs=3, max_blocks_per_seq=5, q_shape=(2, 4), dtype=torch.float32,
                                device=torch.device("cpu"), linear_attention=LINEAR)
    graphs.forwards = {8: FakeForward(8), 16: FakeForward(16)}
    assert graphs.delta.qkv.shape == (16, 6) and graphs.delta.out.shape == (16, 2, 2)
    tokens, positions = [11, 12, 13, 21, 22, 23, 24], np.array([5, 6, 7, 0, 1, 2, 3])
    slots, tables = np.array([40, 41, 42, 8, 9, 10, 11]), np.array([[2, 3, 9], [1, 0, 0]], dtype=np.int32)
    graphs.replay(tokens, positions, slots, [3, 4], [8, 4], tables, StepStates([5, 2], [True, False], ()))
    meta = graphs.forwards[8].metas[0]
    assert meta.state_slots.tolist() == [5, 2] and meta.continues_state_device.tolist() == [1, 0]
    assert meta.continues_state == [True, False] and meta.state_saves == () and meta.delta_chunks is None
    assert meta.slot_mapping.tolist() == slots.tolist() + [-1] and meta.cu_seqlens_q.tolist() == [0, 3, 7]
    assert meta.context_lens.tolist() == [8, 4] and meta.valid_rows.tolist() == [7] and meta.other_groups == ()
    saves = (StateSave(0, 0, 9, 0),)
    graphs.replay(tokens[:4], positions[:4], slots[:4], [4], [4], tables[1:], StepStates([1], [False], saves))
    meta = graphs.forwards[8].metas[1]
    assert meta.state_slots.tolist() == [1] and meta.continues_state_device.tolist() == [0]
    assert meta.state_saves == saves and meta.delta_chunks.count == 1 and meta.delta_chunks.lens.tolist() == [4]
    with pytest.raises(ValueError, match="StepStates"):
        graphs.replay(tokens, positions, slots, [3, 4], [8, 4], tables)
    plain = pw.PiecewiseGraphs([8], max_seqs=3, max_blocks_per_seq=5, q_shape=(2, 4), dtype=torch.float32,
                               device=torch.device("cpu"))
    with pytest.raises(ValueError, match="StepStates"):
        plain.replay(tokens, positions, slots, [3, 4], [8, 4], tables, StepStates([5, 2], [True, False], ()))


def test_a_hybrid_models_capture_runs_one_sequence_from_state_slot_zero(monkeypatch):
    """The warm-up and the capture of each bucket run the delta rule for real: one sequence starting (not
    continuing) in state slot 0, through the runner's linear-attention buffers."""
    graphs = pw.PiecewiseGraphs([8], max_seqs=2, max_blocks_per_seq=4, q_shape=(1, 2), dtype=torch.float32,
                                device=torch.device("cpu"), linear_attention=LINEAR)
    graphs.state_slots.fill_(7)
    seen = []

    def model(tokens, positions, meta):
        seen.append((meta.state_slots.tolist(), meta.continues_state_device.tolist(), meta.continues_state,
                     meta.state_saves))

    def fake_capture(model_, tokens, positions, meta, q_buffer, out_buffer, pool, delta):
        seen.append(delta is graphs.delta)
        return pw.PiecewiseForward([FakeGraph()], [], None)

    monkeypatch.setattr(pw, "capture_piecewise", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs.capture(model)
    assert seen == [([0], [0], [False], ()), True]
