"""Broken checkpoints give one clear error naming the file and the tensor, and the CLI exits non-zero."""

import json
import os

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.errors import CheckpointError
from tests.checkpoint.factory import CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict, linear_modules, write_dir

K = "model.layers.1.self_attn.k_proj"


def _nvfp4_dir(path, mutate=None, config=TINY, qc=CT_NVFP4_CONFIG):
    tensors = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    if mutate:
        mutate(tensors)
    return write_dir(str(path), tensors, config, qc)


def _open_and_read(path):
    ckpt = open_checkpoint(path)
    for _ in ckpt.iter_weights(progress=False):
        pass


def test_truncated_safetensors(tmp_path):
    path = _nvfp4_dir(tmp_path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as handle:
        handle.truncate(os.path.getsize(file) - 100)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        _open_and_read(path)
    assert info.value.file == file


def test_missing_tensor(tmp_path):
    path = _nvfp4_dir(tmp_path, lambda t: t.pop(f"{K}.weight_scale"))
    with pytest.raises(CheckpointError, match="missing") as info:
        _open_and_read(path)
    assert info.value.tensor == f"{K}.weight_scale" and f"{K}.weight_scale" in str(info.value)


def test_missing_projection(tmp_path):
    def drop(t):
        for leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
            t.pop(f"{K}.{leaf}")
    with pytest.raises(CheckpointError, match="missing") as info:
        _open_and_read(_nvfp4_dir(tmp_path, drop))
    assert info.value.tensor == f"{K}.weight_packed"


def test_missing_norm(tmp_path):
    with pytest.raises(CheckpointError, match="missing") as info:
        _open_and_read(_nvfp4_dir(tmp_path, lambda t: t.pop("model.layers.0.input_layernorm.weight")))
    assert info.value.tensor == "model.layers.0.input_layernorm.weight"


def test_wrong_shape(tmp_path):
    def widen(t):
        t[f"{K}.weight_packed"] = torch.zeros(32, 48, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"wrong shape \[32, 48\].*expected \[32, 32\]") as info:
        _open_and_read(_nvfp4_dir(tmp_path, widen))
    assert info.value.tensor == f"{K}.weight_packed" and info.value.file.endswith("model.safetensors")


def test_wrong_dtype(tmp_path):
    def as_fp32(t):
        t[f"{K}.weight_scale"] = t[f"{K}.weight_scale"].float()
    with pytest.raises(CheckpointError, match="wrong dtype float32.*float8_e4m3fn") as info:
        _open_and_read(_nvfp4_dir(tmp_path, as_fp32))
    assert info.value.tensor == f"{K}.weight_scale"


def test_wrong_embedding_shape(tmp_path):
    def shrink(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100]
    with pytest.raises(CheckpointError, match=r"wrong shape \[100, 64\]") as info:
        _open_and_read(_nvfp4_dir(tmp_path, shrink))
    assert info.value.tensor == "model.embed_tokens.weight"


def test_unknown_quant_method(tmp_path):
    with pytest.raises(CheckpointError, match="quant_method 'awq'") as info:
        _open_and_read(_nvfp4_dir(tmp_path, qc={"quant_method": "awq", "bits": 4}))
    assert info.value.file.endswith("config.json")


def test_bad_config_json(tmp_path):
    path = _nvfp4_dir(tmp_path)
    with open(os.path.join(path, "config.json"), "w") as handle:
        handle.write('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON") as info:
        _open_and_read(path)
    assert info.value.file.endswith("config.json")


def test_bad_config_value(tmp_path):
    path = _nvfp4_dir(tmp_path, config=dict(TINY, hidden_size="64"))
    with pytest.raises(CheckpointError, match="'hidden_size' must be a positive integer"):
        _open_and_read(path)


def test_cli_exits_non_zero_with_one_line(tmp_path, capsys):
    from radiance.cli import main

    path = _nvfp4_dir(tmp_path, lambda t: t.pop(f"{K}.weight_scale"))
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radiance inspect: error:") and f"{K}.weight_scale" in err[0]
    assert main(["convert", path, str(tmp_path / "out"), "--format", "mxfp4"]) == 2
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    with open(os.path.join(path, "config.json")) as handle:
        assert json.load(handle)["quantization_config"]["quant_method"] == "compressed-tensors"
