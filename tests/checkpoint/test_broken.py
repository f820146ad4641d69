"""More broken checkpoints and options: each is one CheckpointError / ConfigError naming the file and the
tensor (or key) at fault, the CLI prints one line, and a failed `convert` leaves nothing behind."""

import json
import os
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.cli import main
from radiance.config import ConvertConfig
from radiance.errors import CheckpointError
from radiance.formats import quantize_mxfp4
from tests.checkpoint.factory import (CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict, linear_modules,
                                      write_dir)

K = "model.layers.1.self_attn.k_proj"
DOWN = "model.layers.0.mlp.down_proj"
MXFP4_CONFIG = dict(CT_NVFP4_CONFIG, format="mxfp4-pack-quantized", config_groups={"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                       "strategy": "group", "dynamic": False},
    "input_activations": None, "output_activations": None}})
FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}}}


def _read_all(path):
    for _ in open_checkpoint(path).iter_weights(progress=False):
        pass


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"radiance {command}: error:"), err
    return err[0]


def _with_nan(tensors, name, row=3):
    w = tensors[name].clone()
    w[row, 0] = float("nan")
    tensors[name] = w


# ---------------------------------------------------------------- safetensors headers


def _rewrite_header(file, edit):
    with open(file, "rb") as handle:
        raw = handle.read()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def test_a_truncated_safetensors_file_names_the_first_tensor_past_its_end(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(size))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    os.truncate(file, os.path.getsize(file) - 100)
    with pytest.raises(CheckpointError, match="truncated") as info:
        _read_all(path)
    assert info.value.file == file and info.value.tensor == last


def test_a_header_that_lies_about_offsets_names_the_tensor(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    file = os.path.join(path, "model.safetensors")

    def stretch(header):
        start, end = header[f"{DOWN}.weight"]["data_offsets"]
        header[f"{DOWN}.weight"]["data_offsets"] = [start, end + 10**6]
    _rewrite_header(file, stretch)
    with pytest.raises(CheckpointError) as info:
        _read_all(path)
    assert info.value.file == file and info.value.tensor == f"{DOWN}.weight"


def test_an_index_with_non_string_files_is_a_checkpoint_error(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"weight_map": {"lm_head.weight": 3}}, handle)
    with pytest.raises(CheckpointError, match="weight_map") as info:
        _read_all(path)
    assert info.value.file.endswith("model.safetensors.index.json") and info.value.tensor == "lm_head.weight"


@pytest.mark.parametrize("content,says", [("[1, 2]", "must hold a JSON object"), ("{not json", "not valid JSON"),
                                          ("", "not valid JSON")])
def test_an_index_that_is_no_json_object_names_its_file(tmp_path, content, says):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        handle.write(content)
    with pytest.raises(CheckpointError, match=f"safetensors index .*{says}") as info:
        _read_all(path)
    assert info.value.file.endswith("model.safetensors.index.json")


# ---------------------------------------------------------------- config.json and friends


def test_safetensors_without_config_json_say_config_json_is_missing(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="config.json not found") as info:
        open_checkpoint(path)
    assert info.value.file == os.path.join(path, "config.json")


def test_an_unreadable_config_json_is_a_checkpoint_error(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    os.remove(os.path.join(path, "config.json"))
    os.mkdir(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="cannot read config.json") as info:
        open_checkpoint(path)
    assert info.value.file == os.path.join(path, "config.json")


@pytest.mark.parametrize("key, value", [("num_attention_heads", "4"), ("num_key_value_heads", 0),
                                        ("intermediate_size", -96), ("head_dim", 16.5)])
def test_config_sizes_must_be_positive_integers(tmp_path, key, value):
    path = write_dir(str(tmp_path), dense_state_dict(), dict(TINY, **{key: value}))
    with pytest.raises(CheckpointError, match=f"'{key}' must be a positive integer") as info:
        open_checkpoint(path)
    assert info.value.file.endswith("config.json")


def test_config_architectures_must_be_a_list(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), dict(TINY, architectures="LlamaForCausalLM"))
    with pytest.raises(CheckpointError, match="'architectures' must be a list") as info:
        open_checkpoint(path)
    assert info.value.file.endswith("config.json")


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_a_non_integer_eos_token_id_names_its_file(tmp_path, where):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    if where == "config.json":
        path = write_dir(str(tmp_path), dense_state_dict(), dict(TINY, eos_token_id="abc"))
    else:
        with open(os.path.join(path, where), "w") as handle:
            json.dump({"eos_token_id": [2, "abc"]}, handle)
    with pytest.raises(CheckpointError, match="eos_token_id") as info:
        open_checkpoint(path).eos_token_ids
    assert info.value.file == os.path.join(path, where)


# ---------------------------------------------------------------- scales


def _mxfp4_tensors():
    out = dense_state_dict()
    for m in linear_modules():
        out[f"{m}.weight_packed"], out[f"{m}.weight_scale"] = quantize_mxfp4(out.pop(f"{m}.weight").float())[:2]
    return out


def _fp8_tensors():
    out = dense_state_dict()
    for m in linear_modules():
        w = out.pop(f"{m}.weight").float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        out[f"{m}.weight"], out[f"{m}.weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
    return out


def _nan_nvfp4_block_scale(t):
    scale = t[f"{K}.weight_scale"].view(torch.uint8).clone()
    scale[0, 0] = 0x7F  # the e4m3fn NaN
    t[f"{K}.weight_scale"] = scale.view(torch.float8_e4m3fn)


def _nan_mxfp4_scale(t):
    t[f"{K}.weight_scale"] = t[f"{K}.weight_scale"].clone()
    t[f"{K}.weight_scale"][0, 0] = 0xFF  # the e8m0 NaN


def _nan_fp8_scale(t):
    _with_nan(t, f"{K}.weight_scale")


def _negative_fp8_scale(t):
    t[f"{K}.weight_scale"] = -t[f"{K}.weight_scale"]


def _zero_fp8_scale(t):  # loaded silently: the k_proj served as zeros
    t[f"{K}.weight_scale"] = torch.zeros_like(t[f"{K}.weight_scale"])


def _zero_nvfp4_block_scales(t):
    t[f"{K}.weight_scale"] = torch.zeros_like(t[f"{K}.weight_scale"].view(torch.uint8)).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("tensors, qc, corrupt", [
    (lambda: ct_nvfp4_tensors(dense_state_dict(), linear_modules()), CT_NVFP4_CONFIG, _nan_nvfp4_block_scale),
    (_mxfp4_tensors, MXFP4_CONFIG, _nan_mxfp4_scale),
    (_fp8_tensors, FP8_CONFIG, _nan_fp8_scale),
    (_fp8_tensors, FP8_CONFIG, _negative_fp8_scale),
    (_fp8_tensors, FP8_CONFIG, _zero_fp8_scale),
    (lambda: ct_nvfp4_tensors(dense_state_dict(), linear_modules()), CT_NVFP4_CONFIG, _zero_nvfp4_block_scales),
], ids=["nvfp4-nan-block-scale", "mxfp4-scale-0xff", "fp8-nan-scale", "fp8-negative-scale", "fp8-all-zero-scale",
        "nvfp4-all-zero-block-scales"])
def test_a_bad_scale_is_named_when_read(tmp_path, tensors, qc, corrupt):
    sd = tensors()
    corrupt(sd)
    path = write_dir(str(tmp_path), sd, TINY, qc)
    with pytest.raises(CheckpointError, match="scale") as info:
        _read_all(path)
    assert info.value.tensor == f"{K}.weight_scale" and info.value.file.endswith("model.safetensors")


def test_a_nan_scale_of_stacked_experts_is_named_when_read(tmp_path):
    """gpt-oss keeps all experts of a layer in `*_blocks` / `*_scales` tensors."""
    from safetensors.torch import save_file

    from radiance.checkpoint.safetensors_io import SafetensorsIndex
    from radiance.checkpoint.stacked_experts import find_stacked_experts, read_stacked_experts

    experts, hidden, inter, p = 2, 64, 32, "model.layers.0.mlp.experts"
    tensors = {}
    for proj, (n, k) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
        tensors[f"{p}.{proj}_blocks"] = torch.zeros(experts, n, k // 32, 16, dtype=torch.uint8)
        tensors[f"{p}.{proj}_scales"] = torch.full((experts, n, k // 32), 127, dtype=torch.uint8)
        tensors[f"{p}.{proj}_bias"] = torch.zeros(experts, n)
    tensors[f"{p}.down_proj_scales"][1, 5, 0] = 0xFF
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = SafetensorsIndex(str(tmp_path))
    groups = find_stacked_experts(index, {"hidden_size": hidden, "intermediate_size": inter, "num_local_experts": 2})
    with pytest.raises(CheckpointError, match="scales") as info:
        list(read_stacked_experts(groups[p], index))
    assert info.value.tensor == f"{p}.down_proj_scales" and info.value.file.endswith("model.safetensors")


def test_a_modelopt_checkpoint_missing_its_second_scale_names_weight_scale_2(tmp_path):
    sd = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    for m in linear_modules():
        sd[f"{m}.weight"] = sd.pop(f"{m}.weight_packed")
        sd[f"{m}.weight_scale_2"] = (1.0 / sd.pop(f"{m}.weight_global_scale")).reshape(())
    del sd[f"{K}.weight_scale_2"]
    path = write_dir(str(tmp_path), sd, TINY, {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                              "exclude_modules": ["lm_head"]})
    with pytest.raises(CheckpointError, match="missing") as info:
        open_checkpoint(path)
    assert info.value.tensor == f"{K}.weight_scale_2"


# ---------------------------------------------------------------- GGUF metadata


def _gguf_without(tmp_path, missing: str) -> str:
    path = str(tmp_path / "model.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    fields = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128, "head_count": 4}
    for name, value in fields.items():
        if name != missing:
            getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("missing", ["embedding_length", "head_count", "block_count", "feed_forward_length"])
def test_a_gguf_missing_required_metadata_names_the_key(tmp_path, missing):
    path = _gguf_without(tmp_path, missing)
    key = f"llama.{missing.replace('head_count', 'attention.head_count')}"
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as info:
        open_checkpoint(path)
    assert info.value.file == path


# ---------------------------------------------------------------- convert


def test_a_nan_weight_is_named_by_convert(tmp_path):
    sd = dense_state_dict()
    _with_nan(sd, f"{K}.weight")  # inside the merged qkv_proj: the message names k_proj, not qkv_proj
    path = write_dir(str(tmp_path / "src"), sd, TINY)
    with pytest.raises(CheckpointError, match="NaN") as info:
        convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert info.value.tensor == f"{K}.weight" and info.value.file == os.path.join(path, "model.safetensors")


@pytest.mark.parametrize("dst_exists", [False, True])
def test_a_failed_convert_leaves_nothing_behind(tmp_path, dst_exists):
    sd = dense_state_dict()
    _with_nan(sd, "model.layers.1.mlp.down_proj.weight")  # late in the stream: earlier shards are written
    path = write_dir(str(tmp_path / "src"), sd, TINY, tokenizer=True)
    dst = tmp_path / "out"
    if dst_exists:
        dst.mkdir()
    config = ConvertConfig(format="mxfp4", max_shard_bytes=4096)
    with pytest.raises(CheckpointError):
        convert_checkpoint(path, str(dst), config, progress=False)
    assert (dst.exists() and os.listdir(dst) == []) if dst_exists else not dst.exists()
    # and the same destination takes a second attempt
    with pytest.raises(CheckpointError, match="NaN"):
        convert_checkpoint(path, str(dst), config, progress=False)


def test_convert_rejects_a_bad_ignore_regex_before_writing(tmp_path, capsys):
    path = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)
    assert main(["convert", path, str(tmp_path / "out"), "--ignore", "(", "--no-progress"]) == 2
    assert "ignore: '(' is not a regular expression" in _one_error_line(capsys, "convert")
    assert not (tmp_path / "out").exists()


def test_convert_into_a_path_below_a_file_is_one_line(tmp_path, capsys):
    path = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)
    (tmp_path / "file").write_text("x")
    assert main(["convert", path, str(tmp_path / "file" / "out"), "--no-progress"]) == 2
    assert str(tmp_path / "file") in _one_error_line(capsys, "convert")


def test_a_bad_regex_option_of_any_command_is_one_line(tmp_path, capsys):
    """--ignore of generate / serve is checked where the engine's config is built, before the model loads."""
    path = write_dir(str(tmp_path), dense_state_dict(), TINY, tokenizer=True)
    args = ["generate", "w5", "--model", path, "--ignore", "(", "--quantization", "mxfp4", "--max-tokens", "1"]
    assert main(args) == 2
    assert "ignore: '(' is not a regular expression" in _one_error_line(capsys, "generate")


@pytest.mark.parametrize("quantization", ["mxfp4", "nvfp4"])
def test_a_nan_weight_quantized_at_load_is_named(tmp_path, quantization):
    """`generate --quantization mxfp4` on a 16-bit model with a NaN said "w contains NaN or inf" and named nothing."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    sd = dense_state_dict()
    _with_nan(sd, f"{K}.weight")
    path = write_dir(str(tmp_path / "src"), sd, TINY)
    with pytest.raises(CheckpointError, match="NaN") as info:
        load_model(ModelConfig(device="cpu", dtype="float32", quantization=quantization),
                   checkpoint=open_checkpoint(path), progress=False)
    assert info.value.tensor == f"{K}.weight" and info.value.file == os.path.join(path, "model.safetensors")


def _write_sharded(path, tensors, config, shard_of) -> None:
    """A checkpoint in two shards: shard_of(name) is 1 or 2."""
    os.makedirs(path, exist_ok=True)
    weight_map = {n: f"model-0000{shard_of(n)}-of-00002.safetensors" for n in tensors}
    for file in set(weight_map.values()):
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, os.path.join(path, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)


def test_a_nan_weight_quantized_at_load_names_its_shard(tmp_path):
    """Was: the checkpoint directory, which does not say which of its files holds the NaN."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    sd = dense_state_dict()
    _with_nan(sd, f"{K}.weight")
    path = str(tmp_path / "src")
    _write_sharded(path, sd, TINY, lambda name: 2 if name.startswith(f"{K}.") else 1)
    with pytest.raises(CheckpointError, match="NaN") as info:
        load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4"),
                   checkpoint=open_checkpoint(path), progress=False)
    assert info.value.tensor == f"{K}.weight"
    assert info.value.file == os.path.join(path, "model-00002-of-00002.safetensors")


def test_file_of_a_linear_is_its_shard_or_the_directory(tmp_path):
    """A merged linear is named by its one shard; split over two, by the directory (no one file holds it)."""
    path = str(tmp_path / "src")
    q = K.replace("k_proj", "q_proj")
    _write_sharded(path, dense_state_dict(), TINY, lambda name: 2 if name.startswith((K, DOWN)) else 1)
    ckpt = open_checkpoint(path)
    down_file = os.path.join(path, "model-00002-of-00002.safetensors")
    assert ckpt.file_of(DOWN) == ckpt.file_of(f"{DOWN}.weight") == down_file
    assert ckpt.file_of(f"{q}.weight") == os.path.join(path, "model-00001-of-00002.safetensors")
    assert ckpt.file_of(K.replace("k_proj", "qkv_proj")) == path  # q, v in shard 1, k in shard 2


def test_convert_writes_the_dtype_it_wrote_under_both_names(tmp_path):
    """transformers 5 reads `dtype` before `torch_dtype`: a source's `dtype` was copied as it was, stale."""
    import json

    path = write_dir(str(tmp_path / "src"), dense_state_dict(), {**TINY, "dtype": "float32"})
    convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4", dense_dtype="float16"),
                       progress=False)
    with open(tmp_path / "out" / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    assert (config["dtype"], config["torch_dtype"]) == ("float16", "float16")


def test_a_fifo_for_weights_config_or_gguf_is_refused_not_waited_on(tmp_path):
    """open() of a FIFO blocks until a writer comes: each is named as not a regular file instead."""
    path = str(tmp_path / "m")
    write_dir(path, dense_state_dict(), TINY)
    os.remove(os.path.join(path, "model.safetensors"))
    os.mkfifo(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"not a regular file .*model\.safetensors"):
        open_checkpoint(path)
    os.remove(os.path.join(path, "config.json"))
    os.mkfifo(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=r"config.json: not a regular file .*config\.json"):
        open_checkpoint(path)
    os.mkfifo(str(tmp_path / "x.gguf"))
    with pytest.raises(CheckpointError, match=r"not a regular file .*x\.gguf"):
        open_checkpoint(str(tmp_path / "x.gguf"))


def test_unreadable_weights_and_directories_say_permission_denied(tmp_path, monkeypatch):
    """safetensors reports a file it may not read as missing, and an unreadable directory lists as empty ("holds
    neither config.json nor a .gguf file"): both say permission denied (os.access stubbed: the tests run as root)."""
    path = str(tmp_path / "m")
    write_dir(path, dense_state_dict(), TINY)
    weights = os.path.join(path, "model.safetensors")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == weights else real(p, mode))
    with pytest.raises(CheckpointError, match=r"permission denied: the file is not readable .*model\.safetensors"):
        open_checkpoint(path)
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == path else real(p, mode))
    with pytest.raises(CheckpointError, match="permission denied: the directory is not readable"):
        open_checkpoint(path)


def test_a_dtype_torch_lacks_is_named_as_the_header_spells_it(tmp_path):
    sd = dense_state_dict()
    sd[DOWN + ".weight"] = sd[DOWN + ".weight"].view(torch.int16).to(torch.uint16)
    path = str(tmp_path / "m")
    write_dir(path, sd, TINY)
    with pytest.raises(CheckpointError, match=r"wrong dtype U16"):
        open_checkpoint(path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/outside.safetensors", "a/../../x.safetensors"])
def test_an_index_naming_a_file_outside_the_model_directory_is_refused(tmp_path, shard):
    """A Hub repo's model.safetensors.index.json could point the server at any file it can read."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"weight_map": {"model.norm.weight": shard}}, handle)
    with pytest.raises(CheckpointError, match="a file outside the model directory"):
        open_checkpoint(path)


def test_an_index_naming_shards_in_a_subdirectory_still_reads(tmp_path):
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY)
    os.makedirs(os.path.join(path, "weights"))
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "weights", "model.safetensors"))
    names = list(_stored_names(os.path.join(path, "weights", "model.safetensors")))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"weight_map": {name: "weights/../weights/model.safetensors" for name in names}}, handle)
    assert sorted(open_checkpoint(path).index.meta) == sorted(names)


def _stored_names(shard: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(shard, "pt") as handle:
        return list(handle.keys())
