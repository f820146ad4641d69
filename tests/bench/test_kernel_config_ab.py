"""tools/kernel_config_ab.py: values parse as the field's type, the field lands on the linears asked for,
and the harness runs end to end (a CPU dry run)."""

import math
import sys
from pathlib import Path

import pytest

from radiance.layers.linear import Mxfp4Linear
from tests.bench.test_bench_synthetic import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import kernel_config_ab as ab  # noqa: E402


def test_values_parse_as_the_field_type():
    assert ab.parse_value("defer_split_sum", "false") is False
    assert ab.parse_value("defer_split_sum", "True") is True
    assert ab.parse_value("decode_band", "32") == 32
    with pytest.raises(ValueError, match="true or false"):
        ab.parse_value("fuse_glu", "maybe")
    with pytest.raises(ValueError, match="not a KernelConfig field"):
        ab.parse_value("block_n", "64")


def test_dry_run_on_the_cpu_sets_only_the_named_linears():
    lines = []
    result = ab.run("synthetic:llama-3.1-8b", "defer_split_sum", [False, True], [1, 2], only=("down_proj",),
                    device="cpu", repeats=1, steps=2, overrides={**TINY, "vocab_size": 512}, log=lines.append)
    assert result["tokens_equal"] is True  # the CPU reference path never defers
    assert set(result["ms"]) == {False, True}
    assert all(math.isfinite(ms) and ms > 0 for reps in result["ms"].values() for row in reps for ms in row)
    assert len(lines) == 3


def test_set_field_touches_the_suffixed_linears_only():
    from types import SimpleNamespace

    import torch

    from tests.kernels.conftest import random_mxfp4

    down, o = Mxfp4Linear(*random_mxfp4(8, 64, "cpu")), Mxfp4Linear(*random_mxfp4(8, 64, "cpu"))
    model = torch.nn.ModuleDict({"down_proj": down, "o_proj": o})
    engine = SimpleNamespace(model=model, runner=SimpleNamespace(decode_graphs=None))
    ab.set_field(engine, "defer_split_sum", False, ("down_proj",))
    assert down.kernel_config.defer_split_sum is False and o.kernel_config.defer_split_sum is True
