"""A NaN or inf in a weight served as 16-bit values is a CheckpointError at load naming the tensor and the shard
holding it (was: loaded without a word, and the model answered garbage)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.formats._checks import nonfinite_count
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, linear_modules

NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
UP = "model.layers.1.mlp.up_proj.weight"  # served merged with gate_proj (gate_up_proj)
K = "model.layers.0.self_attn.k_proj.weight"  # merged into qkv_proj
SHARD_2 = "model-00002-of-00002.safetensors"


def _write(path, tensors, config=TINY, in_shard_2=()) -> str:
    """Two shards: the tensors named in `in_shard_2` in the second."""
    weight_map = {n: SHARD_2 if n in in_shard_2 else "model-00001-of-00002.safetensors" for n in tensors}
    for file in set(weight_map.values()):
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, os.path.join(path, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)
    return str(path)


def _load(path, **options):
    options.setdefault("dtype", "float32")
    return load_model(ModelConfig(device="cpu", **options), checkpoint=open_checkpoint(path), progress=False)


@pytest.mark.parametrize("name, bad, dtype", [
    (NORM, float("nan"), "float32"),
    (EMBED, float("inf"), "bfloat16"),
    (HEAD, float("-inf"), "float32"),
    (UP, float("nan"), "float32"),  # a 16-bit linear: the partition is named, not gate_up_proj
    (K, float("inf"), "bfloat16"),
])
def test_a_nan_or_inf_weight_is_named_with_its_shard(tmp_path, name, bad, dtype):
    tensors = dense_state_dict()
    tensors[name].view(-1)[7] = bad
    path = _write(tmp_path, tensors, in_shard_2={name})
    with pytest.raises(CheckpointError, match=r"^1 NaN or inf value\(s\) in the weight") as info:
        _load(path, dtype=dtype)
    assert info.value.tensor == name and info.value.file == os.path.join(path, SHARD_2)


def test_an_fp8_weight_served_dequantized_with_a_nan_code_is_named(tmp_path):
    """--quantization none serves an fp8 checkpoint's linears as 16-bit values: a NaN code (0x7f) among them
    was served as NaN."""
    tensors = dense_state_dict()
    for module in linear_modules():
        w = tensors.pop(f"{module}.weight").float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
    tensors[K].view(torch.uint8)[3, 0] = 0x7F
    config = dict(TINY, quantization_config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}}})
    path = _write(tmp_path, tensors, config, in_shard_2={K, K.replace(".weight", ".weight_scale")})
    with pytest.raises(CheckpointError, match="NaN or inf") as info:
        _load(path, quantization="none")
    assert info.value.tensor == K and info.value.file == os.path.join(path, SHARD_2)


def test_finite_weights_whose_sum_overflows_load(tmp_path):
    """The check sums each tensor first: float16 norms of 60000 sum past float16's range, yet are finite."""
    tensors = dense_state_dict(dtype=torch.float16)
    tensors[NORM] = torch.full_like(tensors[NORM], 60000.0)
    model = _load(_write(tmp_path, tensors), dtype="float16").model
    assert model.get_parameter(NORM)[0] == 60000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_count(dtype):
    t = torch.randn(1000, 333).to(dtype)
    assert nonfinite_count(t) == 0
    t[-1, -1], t[500, 7], t[0, 0] = float("nan"), float("inf"), float("-inf")
    assert nonfinite_count(t) == 3
    t[500, 7] = float("-inf")  # +inf and -inf sum to NaN: still found
    assert nonfinite_count(t) == 3
    assert nonfinite_count(torch.tensor([1, 2])) == 0  # integer tensors hold no NaN
    big = torch.full((4,), torch.finfo(dtype).max).to(dtype)  # finite values whose sum overflows: counted exactly
    assert nonfinite_count(big) == 0


def test_nonfinite_count_of_fp8():
    """torch sums no fp8 dtype: counted in float32 (inspect --values reads FP8 checkpoints' codes)."""
    t = torch.zeros(100).to(torch.float8_e4m3fn)
    assert nonfinite_count(t) == 0
    t.view(torch.uint8)[[3, 50]] = 0x7F  # e4m3fn's NaN (it has no inf)
    assert nonfinite_count(t) == 2
