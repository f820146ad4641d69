"""The shipped tuning tables: every entry is a valid GemmConfig, and select_config can reach it (an
earlier, broader entry must not shadow it), so a measured tiling is the one that serves its shapes."""

import json
from unittest import mock

import pytest
import torch

from radiance.kernels import tuning
from radiance.kernels.tuning import GemmConfig

TABLES = sorted(tuning.TUNING_DIR.glob("*.json"))


def _entries():
    for path in TABLES:
        table = json.loads(path.read_text())
        for band in ("decode", "prefill"):
            for i, entry in enumerate(table.get(band, [])):
                yield pytest.param(path.stem, band, i, entry, id=f"{path.stem}-{band}-{i}")


def test_tables_exist():
    assert TABLES, f"no tuning tables under {tuning.TUNING_DIR}"


@pytest.mark.parametrize("name,band,index,entry", list(_entries()))
def test_entry_is_reachable_and_valid(name, band, index, entry):
    cfg = GemmConfig(**entry["config"])  # raises on an invalid tiling
    table = json.loads((tuning.TUNING_DIR / f"{name}.json").read_text())
    shape = entry.get("shape", "*")
    n, k = (4104, 4224) if shape == "*" else map(int, shape.split("x"))
    # the largest M of this entry's band that earlier entries do not claim
    if entry.get("m_max") is not None:
        m = entry["m_max"]
    else:
        m = 64 if band == "decode" else table.get("expand_min_m", 4096) - 1
    if band == "prefill":
        m = max(m, 65)
    with mock.patch.object(tuning, "_table_name", lambda device: name):
        chosen = tuning.select_config(m, n, k, 64, torch.device("cpu"))
    expected = cfg.as_dict()
    got = chosen.as_dict()
    expected.pop("block_m"), got.pop("block_m")  # fitted to M by select_config
    assert got == expected, f"{band} entry {index} ({shape}, m_max {entry.get('m_max')}) is shadowed: {chosen}"
    assert chosen.block_m <= max(cfg.block_m, 256)


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_unfused_glu_shapes_are_gate_up_shapes_and_are_honoured(path):
    skip = json.loads(path.read_text()).get("unfused_glu_shapes", [])
    for shape in skip:
        n, k = map(int, shape.split("x"))  # "NxK"
        assert n % 2 == 0 and n > 0 and k % 32 == 0, shape
    with mock.patch.object(tuning, "_table_name", lambda device: path.stem):
        for shape in skip:
            n, k = map(int, shape.split("x"))
            assert not tuning.glu_epilogue_serves(n, k, torch.device("cpu"))
        assert tuning.glu_epilogue_serves(28672, 4096, torch.device("cpu")) == ("28672x4096" not in skip)
    assert tuning.glu_epilogue_serves(51200, 5120, torch.device("cpu"))  # no table here: always fused


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_moe_expand_shapes_are_gate_up_shapes_and_are_honoured(path):
    listed = json.loads(path.read_text()).get("moe_expand_shapes", [])
    for shape in listed:
        n, k = map(int, shape.split("x"))  # "NxK" of the merged [gate | up] weight
        assert n % 32 == 0 and n > 0 and k % 16 == 0, shape  # fp8 GEMM operands: multiples of 16
    with mock.patch.object(tuning, "_table_name", lambda device: path.stem):
        for shape in listed:
            n, k = map(int, shape.split("x"))
            assert tuning.moe_expand_listed(n, k, torch.device("cpu"))
        assert tuning.moe_expand_listed(1536, 2048, torch.device("cpu")) == ("1536x2048" in listed)
    assert not tuning.moe_expand_listed(5760, 2880, torch.device("cpu"))  # no table here: never
