"""The whole-step graph families on the CPU: buckets, captures largest first in one pool, and the static inputs a
replay fills, with stand-ins for the captured forwards (the real graphs against eager steps, on a GPU:
test_gpu_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radiance.engine import step_graphs as sg

CPU = torch.device("cpu")


class FakeGraph:
    """A captured forward: replays log its name; its output is a fixed hidden tensor."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def pool(self):
        return "pool-of-" + self.name

    def replay(self):
        self.log.append(("replay", self.name))


@pytest.fixture
def captured(monkeypatch):
    """Replaces capture_forward: records what each capture sees (rows, metadata, pool) and returns a fake graph
    whose hidden rows are their own row index."""
    log = []

    def fake_capture(model, pool, tokens, positions, meta):
        name = f"graph{sum(1 for e in log if e[0] == 'capture')}"
        log.append(("capture", name, tokens.shape[0], pool, meta))
        hidden = torch.arange(tokens.shape[0], dtype=torch.float32)[:, None].expand(-1, 2)
        return FakeGraph(name, log), hidden

    monkeypatch.setattr(sg, "capture_forward", fake_capture)
    return log


def test_graph_buckets():
    assert sg.graph_buckets(1) == [1]
    assert sg.graph_buckets(8) == [1, 2, 4, 8]
    assert sg.graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert sg.graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_decode_split_count_fills_the_gpu_and_stays_in_range():
    assert sg.decode_num_splits(1, 8) == 32  # 264 CTAs wanted: capped at 32 splits
    assert sg.decode_num_splits(4, 8) == 9
    assert sg.decode_num_splits(64, 8) == 1


def test_decode_capture_takes_the_buckets_largest_first_in_one_pool(captured):
    graphs = sg.DecodeGraphs(max_batch=8, max_blocks_per_seq=3, num_kv_heads=8, device=CPU)
    graphs.capture(model=None)
    assert [(e[1], e[2], e[3]) for e in captured] == [("graph0", 8, None), ("graph1", 4, "pool-of-graph0"),
                                                       ("graph2", 2, "pool-of-graph1"), ("graph3", 1, "pool-of-graph2")]
    for _, _, batch, _, meta in captured:  # each bucket all real rows, split for its own batch
        assert meta.is_decode and meta.q_lens == [1] * batch and meta.decode_splits == sg.decode_num_splits(batch, 8)
        assert meta.slot_mapping.shape == (batch,) and meta.block_tables.shape == (batch, 3)
    assert graphs.batch_row[0] == 1 and graphs.serves(8) and not graphs.serves(9)


def test_a_decode_step_fills_its_bucket_and_pads_the_rest(captured):
    graphs = sg.DecodeGraphs(max_batch=8, max_blocks_per_seq=3, num_kv_heads=8, device=CPU)
    graphs.capture(model=None)
    captured.clear()
    tables = np.array([[4, 5], [7, 0], [9, 2]], dtype=np.int32)
    hidden = graphs.replay([11, 12, 13], np.array([20, 3, 17]), np.array([85, 115, 145]), [21, 4, 18], tables)
    assert captured == [("replay", "graph1")]  # 3 sequences: the 4-bucket
    assert hidden.shape == (3, 2) and hidden[:, 0].tolist() == [0, 1, 2]
    # tokens, positions, context lens, the real-row count in column 0, then the slots; the padding row writes nowhere
    assert graphs.meta[:, :4].tolist() == [[11, 12, 13, 0], [20, 3, 17, 0], [21, 4, 18, 0], [3, 0, 0, 0],
                                           [85, 115, 145, -1]]
    assert graphs.tables[0, :3, :2].tolist() == tables.tolist()
    # tokens already on the device (a step queued behind the one that samples them)
    graphs.replay(torch.tensor([31, 32]), np.array([21, 4]), np.array([86, 116]), [22, 5], tables[:2])
    assert captured[-1] == ("replay", "graph2") and graphs.tokens[:2].tolist() == [31, 32]
    assert graphs.meta[3, 0] == 2


def test_a_decode_step_of_two_kv_groups_fills_each_groups_slots_and_tables(captured):
    """A model with local layers (engine.kv_layout): each KV group's layers read their own slots and tables."""
    graphs = sg.DecodeGraphs(max_batch=4, max_blocks_per_seq=3, num_kv_heads=8, device=CPU, kv_groups=2)
    graphs.capture(model=None)
    for _, _, batch, _, meta in captured:  # group 1's metadata: views of the second rows
        (other,) = meta.other_groups
        assert other.slot_mapping.data_ptr() == graphs.slots[1].data_ptr()
        assert other.block_tables.shape == (batch, 3) and other.block_tables.data_ptr() == graphs.tables[1].data_ptr()
        assert meta.of_group(1) is other and meta.of_group(0) is meta
    tables = np.array([[[4, 5], [7, 0], [9, 2]], [[10, 11], [12, 13], [14, 15]]], dtype=np.int32)
    graphs.replay([11, 12, 13], np.array([20, 3, 17]), np.array([[85, 115, 145], [181, 211, 241]]), [21, 4, 18],
                  tables)
    assert graphs.slots[:, :4].tolist() == [[85, 115, 145, -1], [181, 211, 241, -1]]
    assert graphs.tables[:, :3, :2].tolist() == tables.tolist()


def test_prefill_capture_and_a_chunk_in_its_bucket(captured):
    graphs = sg.PrefillGraphs([16, 8], max_blocks_per_seq=4, device=CPU)
    assert graphs.capture(model=None, pool="start") == "pool-of-graph1"
    assert [(e[1], e[2], e[3]) for e in captured] == [("graph0", 16, "start"), ("graph1", 8, "pool-of-graph0")]
    meta = captured[1][4]  # a bucket's capture: one sequence filling it, every row real
    assert not meta.is_decode and meta.q_lens == [8] and meta.valid_rows.tolist() == [8]
    assert graphs.serves(16) and not graphs.serves(17)
    captured.clear()
    table = np.array([[6, 2, 3]], dtype=np.int32)
    hidden = graphs.replay([1, 2, 3, 4, 5], np.arange(32, 37), np.arange(100, 105), 37, table)
    assert captured == [("replay", "graph1")] and hidden.shape == (5, 2)
    assert graphs.meta[:, :8].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], list(range(32, 37)) + [0] * 3,
                                           list(range(100, 105)) + [-1] * 3]
    # cu_seqlens (0, q_len) and the context length; the real rows are cu_seqlens' end (valid_rows)
    assert graphs.lens.tolist() == [0, 5, 37] and graphs.table[0, 0, :3].tolist() == [6, 2, 3]


def test_a_prefill_chunk_of_two_kv_groups_lands_each_groups_slots_and_table(captured):
    graphs = sg.PrefillGraphs([8], max_blocks_per_seq=6, device=CPU, kv_groups=2)
    graphs.capture(model=None)
    (other,) = captured[0][4].other_groups
    assert other.block_tables.data_ptr() == graphs.table[1].data_ptr() and other.slot_mapping.shape == (8,)
    tables = np.array([[[6, 2, 3, 1, 7]], [[9, 9, 4, 5, 8]]], dtype=np.int32)
    graphs.replay([1, 2, 3], np.arange(16, 19), np.array([[4, 5, 6], [20, 21, 22]]), 19, tables)
    assert graphs.meta[2:, :4].tolist() == [[4, 5, 6, -1], [20, 21, 22, -1]]
    assert graphs.table[:, 0, :5].tolist() == [[6, 2, 3, 1, 7], [9, 9, 4, 5, 8]]
    graphs.replay([4], np.arange(19, 20), np.array([[7], [23]]), 20, tables[:, :, :2])  # a narrower table next
    assert graphs.table[:, 0, :5].tolist() == [[6, 2, 3, 1, 7], [9, 9, 4, 5, 8]]  # the rest is never read


def test_staging_sets_come_in_turn_and_skip_the_last_two():
    staging = sg.StagingSets([((2, 3), torch.long), ((4,), torch.int32)], CPU)
    got = [staging.next() for _ in range(2 * sg.STAGING_SETS)]
    assert all(s[0].shape == (2, 3) and s[0].dtype == torch.long and s[1].dtype == torch.int32 for s in got)
    firsts = [s[0].data_ptr() for s in got]
    assert len(set(firsts)) == sg.STAGING_SETS  # distinct sets, none handed out again within the next two turns
    assert all(firsts[i] not in firsts[i + 1:i + sg.STAGING_SETS] for i in range(len(firsts) - sg.STAGING_SETS))
