"""Loading errors name the tensor at fault and the file holding it: a float32 value that float16 holds only as
inf, and a tensor the model has no place for in a sharded checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

NORM = "model.layers.0.input_layernorm.weight"
UP = "model.layers.1.mlp.up_proj.weight"  # served merged with gate_proj (gate_up_proj)
EMBED = "model.embed_tokens.weight"


def _load(path: str, dtype: str):
    return load_model(ModelConfig(device="cpu", dtype=dtype), checkpoint=open_checkpoint(path), progress=False)


@pytest.mark.parametrize("name", [NORM, UP, EMBED])
def test_a_float32_value_beyond_float16_is_named_at_load(tmp_path, name):
    """Was: loaded as inf without a word (the model then answers NaN)."""
    tensors = dense_state_dict(dtype=torch.float32)
    tensors[name].view(-1)[5] = -1e6
    path = write_dir(str(tmp_path), tensors, dict(TINY, torch_dtype="float32"))
    with pytest.raises(CheckpointError, match=r"cannot load it in float16: a value of magnitude 1e\+06 overflows "
                                              r"float16 \(--dtype bfloat16 holds it\)") as info:
        _load(path, "float16")
    assert info.value.tensor == name and info.value.file == os.path.join(path, "model.safetensors")
    model = _load(path, "bfloat16").model  # the advice holds
    assert all(torch.isfinite(p).all() for p in model.parameters() if p is not None)


def test_float16_loads_what_it_holds(tmp_path):
    tensors = dense_state_dict(dtype=torch.float32)
    tensors[NORM][0] = 65504.0  # float16's largest
    tensors[UP][0, 0] = -65510.0  # rounds to it
    path = write_dir(str(tmp_path), tensors, dict(TINY, torch_dtype="float32"))
    model = _load(path, "float16").model
    assert model.get_parameter(NORM).dtype == torch.float16 and model.get_parameter(NORM)[0] == 65504.0
    assert all(torch.isfinite(p).all() for p in model.parameters() if p is not None)


def test_a_tensor_not_used_by_the_model_is_named_with_its_shard(tmp_path):
    """Was: the error named the checkpoint directory, not which of its files holds the tensor."""
    tensors = dict(dense_state_dict(), **{"model.mtp.fc.weight": torch.ones(8, 8)})
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    assert "model.mtp.fc.weight" in shards["model-00002-of-00002.safetensors"]
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(tmp_path / file))
    with open(tmp_path / "model.safetensors.index.json", "w") as handle:
        json.dump({"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}, handle)
    with open(tmp_path / "config.json", "w") as handle:
        json.dump(TINY, handle)
    with pytest.raises(CheckpointError, match="tensor not used by the model") as info:
        _load(str(tmp_path), "float32")
    assert info.value.tensor == "model.mtp.fc.weight"
    assert info.value.file == str(tmp_path / "model-00002-of-00002.safetensors")
