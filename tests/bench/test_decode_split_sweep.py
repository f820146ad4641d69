"""tools/decode_split_sweep.py: the tuning-table patch it measures must serve exactly the shape and M band
it names and leave the real table alone, and the harness must run end to end (a CPU dry run)."""

import copy
import math
import sys
from pathlib import Path

import pytest

import radiance.kernels.tuning as tuning
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import decode_split_sweep as sweep  # noqa: E402


def test_with_split_serves_only_its_shape_and_band():
    table = tuning.load_table("sm90")
    before = copy.deepcopy(table)
    patched = sweep.with_split(table, "51200x5120", 5, m=1)
    assert table == before  # a copy: the cached table is untouched
    new = sweep.serving_entry(patched, "51200x5120", 1)
    old = sweep.serving_entry(table, "51200x5120", 1)
    assert new["config"]["split_k"] == 5
    assert {k: v for k, v in new["config"].items() if k != "split_k"} == \
        {k: v for k, v in old["config"].items() if k != "split_k"}
    assert sweep.serving_entry(patched, "51200x5120", 2) == sweep.serving_entry(table, "51200x5120", 2)
    assert sweep.serving_entry(patched, "4096x4096", 1) == sweep.serving_entry(table, "4096x4096", 1)


def test_with_split_at_batch_64_keeps_the_smaller_bands():
    """At M = 64 the new entry goes right before the one serving now: the M <= 32 entry still serves M 16."""
    table = tuning.load_table("sm90")
    patched = sweep.with_split(table, "28672x4096", 2, m=64)
    assert sweep.serving_entry(patched, "28672x4096", 64)["config"]["split_k"] == 2
    assert sweep.serving_entry(patched, "28672x4096", 48)["config"]["split_k"] == 2
    assert sweep.serving_entry(patched, "28672x4096", 16) == sweep.serving_entry(table, "28672x4096", 16)
    assert sweep.serving_entry(patched, "28672x4096", 16)["m_max"] == 32


def test_with_field_patches_any_tiling_field_and_checks_it():
    table = tuning.load_table("sm90")
    patched = sweep.with_field(table, "28672x4096", "num_stages", 5, m=1)
    new, old = sweep.serving_entry(patched, "28672x4096", 1), sweep.serving_entry(table, "28672x4096", 1)
    assert new["config"]["num_stages"] == 5
    assert {k: v for k, v in new["config"].items() if k != "num_stages"} == \
        {k: v for k, v in old["config"].items() if k != "num_stages"}
    with pytest.raises(ValueError, match="not a GemmConfig field"):
        sweep.with_field(table, "28672x4096", "stages", 5, m=1)
    with pytest.raises(ValueError, match="block_k"):
        sweep.with_field(table, "28672x4096", "block_k", 200, m=1)


def test_table_in_use_swaps_and_restores():
    real = tuning.load_table
    with sweep.table_in_use({"decode": []}):
        assert tuning.load_table("sm90") == {"decode": []}
    assert tuning.load_table is real


def test_dry_run_on_the_cpu():
    lines = []
    result = sweep.run("synthetic:llama-3.1-8b", values=(1, 2), batch=2, device="cpu",
                       overrides={**TINY, "vocab_size": 512}, steps=2, log=lines.append)
    hidden, inter = TINY["hidden_size"], TINY["intermediate_size"]
    assert f"{2 * inter}x{hidden}" in result["tried"] and f"{hidden}x{inter}" in result["tried"]
    assert all(math.isfinite(ms) and ms > 0 for tried in result["tried"].values() for _, ms in tried)
    assert [v for v, _ in result["final"]] == ["table", "winners"] * 2
    assert len(result["entries"]) == len(result["chosen"])
    assert len(lines) == 2 + len(result["tried"])
    with pytest.raises(ValueError, match="decode band"):
        sweep.run("synthetic:llama-3.1-8b", batch=65, device="cpu")


def test_decode_shapes_leave_out_grouped_experts():
    """Experts stacked for the grouped kernel run its tilings, not the table's: no sweep of their shapes."""
    import torch

    from radiance.layers.linear import Mxfp4Linear
    from radiance.layers.moe import SparseMoeBlock
    from radiance.models.moe_config import MoeConfig

    def linear(n, k):
        return Mxfp4Linear(torch.zeros(n, k // 2, dtype=torch.uint8), torch.full((n, k // 32), 127, dtype=torch.uint8))

    block = SparseMoeBlock(64, MoeConfig(num_experts=2, top_k=1, intermediate_size=32, norm_topk_prob=True,
                                         layers=frozenset({0})))
    for expert in block.experts:
        expert.gate_up_proj, expert.down_proj = linear(64, 64), linear(64, 32)
    model = torch.nn.ModuleDict({"qkv": linear(96, 64), "mlp": block})
    assert sweep.decode_shapes(model) == ["64x32", "64x64", "96x64"]  # a loop over the experts: the table serves
    block.grouped = ("stacked gate_up", "stacked down")  # what finish_loading sets on a GPU
    assert sweep.decode_shapes(model) == ["96x64"]


def test_with_fields_patches_a_whole_tiling():
    table = tuning.load_table("sm90")
    fields = {"block_k": 512, "num_stages": 3, "split_k": 1}
    patched = sweep.with_fields(table, "4096x14336", fields, m=1)
    new, old = sweep.serving_entry(patched, "4096x14336", 1), sweep.serving_entry(table, "4096x14336", 1)
    assert {k: new["config"][k] for k in fields} == fields
    assert {k: v for k, v in new["config"].items() if k not in fields} == \
        {k: v for k, v in old["config"].items() if k not in fields}
    assert sweep.serving_entry(patched, "4096x14336", 2) == sweep.serving_entry(table, "4096x14336", 2)
    with pytest.raises(ValueError, match="not a GemmConfig field"):
        sweep.with_fields(table, "4096x14336", {"block_k": 512, "stages": 3}, m=1)


def test_dry_run_of_whole_tilings_on_the_cpu():
    lines = []
    tilings = [{"block_k": 512, "num_stages": 3}, {"split_k": 2, "num_stages": 5}]
    result = sweep.run("synthetic:llama-3.1-8b", batch=2, device="cpu", overrides={**TINY, "vocab_size": 512},
                       steps=2, log=lines.append, tilings=tilings)
    labels = {label for tried in result["tried"].values() for label, _ in tried}
    assert labels == {"block_k=512,num_stages=3", "split_k=2,num_stages=5"}
    assert all(fields in tilings for fields in result["chosen"].values())
    assert all("(table block_k=" in line for line in lines[1:-1])


def test_candidates_that_launch_the_same_splits_are_tried_once():
    """16 K tiles: split_k 4 and 5 both launch 4 splits of 4 tiles, which is also what the table's "auto" launches
    on 132 SMs (64 tiles, two waves); only tilings that launch something else are timed."""
    now = sweep.serving_entry(tuning.load_table("sm90"), "4096x4096", 1)["config"]
    assert sweep.launched(now, "4096x4096", 1, 132)["split_k"] == 4
    candidates = [{"split_k": s} for s in (4, 5, 3, 6, 7)]
    assert sweep.distinct_candidates(candidates, now, "4096x4096", 1, 132) == [{"split_k": 3}, {"split_k": 6}]
    # another field with the same split count is a different launch; block_m follows M as select_config fits it
    stages = {"num_stages": now["num_stages"] + 1}
    assert sweep.distinct_candidates([stages], now, "4096x4096", 1, 132) == [stages]
    assert sweep.launched(now, "4096x4096", 20, 132)["block_m"] == 32


def test_compare_tables_dry_run_on_the_cpu():
    table = tuning.load_table("sm90")
    real = tuning.load_table
    other = sweep.with_split(table, "64x64", 2, m=1)
    lines = []
    rows = sweep.compare_tables("synthetic:llama-3.1-8b", {"old": other, "repo": table}, [1, 2], device="cpu",
                                overrides={**TINY, "vocab_size": 512}, steps=2, repeats=1, log=lines.append)
    assert [name for name, _ in rows] == ["old", "repo"]
    assert all(len(times) == 2 and all(math.isfinite(ms) and ms > 0 for ms in times) for _, times in rows)
    assert lines[0].startswith("old: batch 1 ") and "batch 2" in lines[0]
    assert tuning.load_table is real
    with pytest.raises(ValueError, match="decode band"):
        sweep.compare_tables("synthetic:llama-3.1-8b", {"repo": table}, [65], device="cpu")
