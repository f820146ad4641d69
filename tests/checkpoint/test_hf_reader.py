"""Reading HF directories: canonical names, merged partitions, shards, compressed-tensors and Quark."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from radiance.checkpoint import open_checkpoint
from radiance.formats import (DenseWeight, Mxfp4Weight, Nvfp4Weight, dequantize, dequantize_nvfp4,
                              quantize_mxfp4)
from tests.checkpoint.factory import (CHAT_TEMPLATE, CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict,
                                      linear_modules, write_dir)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense"))
    return write_dir(path, dense_state_dict(), TINY, tokenizer=True)


def test_dense_names_and_merged_partitions(dense_dir):
    sd = dense_state_dict()
    ckpt = open_checkpoint(dense_dir)
    assert ckpt.kind == "hf" and ckpt.quant.method == "none" and ckpt.warnings == []
    names = ckpt.names()
    assert "model.layers.1.self_attn.qkv_proj" in names and "model.layers.0.mlp.gate_up_proj" in names
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj" not in names
    got = ckpt.state_dict()
    assert set(got) == set(names)
    qkv = got["model.layers.1.self_attn.qkv_proj"]
    assert isinstance(qkv, DenseWeight) and qkv.partition_sizes == (64, 32, 32)
    expected = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.tensor, expected)
    gate_up = got["model.layers.0.mlp.gate_up_proj"]
    assert gate_up.partition_sizes == (96, 96)
    assert torch.equal(gate_up.tensor[96:], sd["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"])  # 16-bit head: a plain tensor


def test_tokenizer_template_and_eos(dense_dir):
    ckpt = open_checkpoint(dense_dir)
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert ckpt.eos_token_ids == [2]
    assert ckpt.tokenizer().encode("w5 w7", add_special_tokens=False) == [5, 7]


def test_sharded_index_is_read(tmp_path):
    sd = dense_state_dict(seed=3)
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / file))
    with open(tmp_path / "model.safetensors.index.json", "w") as handle:
        json.dump({"weight_map": {k: f for f, ks in shards.items() for k in ks}}, handle)
    with open(tmp_path / "config.json", "w") as handle:
        json.dump(TINY, handle)
    got = open_checkpoint(str(tmp_path)).state_dict()
    assert torch.equal(got["model.layers.1.mlp.down_proj"].tensor, sd["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(got["model.norm.weight"], sd["model.norm.weight"])


def test_compressed_tensors_nvfp4_keeps_each_partition_global_scale(tmp_path):
    sd = dense_state_dict()
    quant = ct_nvfp4_tensors(sd, linear_modules())
    ckpt = open_checkpoint(write_dir(str(tmp_path), quant, TINY, CT_NVFP4_CONFIG))
    assert ckpt.warnings == []
    qkv = dict(ckpt.iter_weights(progress=False))["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Nvfp4Weight) and qkv.partition_sizes == (64, 32, 32)
    p = "model.layers.0.self_attn"
    gs = [quant[f"{p}.{x}_proj.weight_global_scale"] for x in "qkv"]
    assert torch.equal(qkv.global_scale, torch.cat(gs))
    # each partition dequantized with its own global scale...
    per_part = torch.cat([dequantize_nvfp4(quant[f"{p}.{x}_proj.weight_packed"], quant[f"{p}.{x}_proj.weight_scale"],
                                           quant[f"{p}.{x}_proj.weight_global_scale"]) for x in "qkv"])
    assert torch.equal(dequantize(qkv), per_part)
    # ...which is not what one collapsed (max) global scale would give
    collapsed = dequantize_nvfp4(qkv.packed, qkv.scale, torch.cat(gs).max().reshape(1))
    assert not torch.allclose(collapsed, per_part)


def test_tensor_named_ignore_is_matched_as_meant(tmp_path):
    sd = dense_state_dict()
    kept = "model.layers.1.mlp.down_proj"
    quant = ct_nvfp4_tensors(sd, [m for m in linear_modules() if m != kept])
    qc = dict(CT_NVFP4_CONFIG, ignore=["lm_head", f"{kept}.weight"])
    ckpt = open_checkpoint(write_dir(str(tmp_path), quant, TINY, qc))
    assert len(ckpt.warnings) == 1 and f"write '{kept}'" in ckpt.warnings[0]
    got = dict(ckpt.iter_weights(progress=False))
    assert isinstance(got[kept], DenseWeight) and torch.equal(got[kept].tensor, sd[f"{kept}.weight"])
    assert isinstance(got["model.layers.0.mlp.down_proj"], Nvfp4Weight)


def test_config_tensor_disagreement_is_warned_and_read_as_stored(tmp_path):
    sd = dense_state_dict()
    quant = ct_nvfp4_tensors(sd, [m for m in linear_modules() if not m.endswith("o_proj")])
    ckpt = open_checkpoint(write_dir(str(tmp_path), quant, TINY, CT_NVFP4_CONFIG))
    assert any("o_proj" in w and "stored as dense" in w for w in ckpt.warnings)
    assert isinstance(dict(ckpt.iter_weights(progress=False))["model.layers.0.self_attn.o_proj"], DenseWeight)


def test_quantized_tensors_without_a_quantization_config_are_worded_so(tmp_path):
    """Was "quantization_config says ... are dense" of a config.json that has no quantization_config."""
    quant = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    ckpt = open_checkpoint(write_dir(str(tmp_path), quant, TINY))
    said = [w for w in ckpt.warnings if "stored as nvfp4" in w]
    assert said and all(w.startswith("config.json has no quantization_config, but ") for w in said), ckpt.warnings
    assert isinstance(dict(ckpt.iter_weights(progress=False))["model.layers.0.self_attn.o_proj"], Nvfp4Weight)


def test_quark_ocp_mx_layout(tmp_path):
    sd = dense_state_dict()
    expected = {}
    for m in linear_modules():
        packed, scale = quantize_mxfp4(sd.pop(f"{m}.weight").float(), "ocp")
        sd[f"{m}.weight"], sd[f"{m}.weight_scale"] = packed, scale
        expected[m] = (packed, scale)
    qc = {"quant_method": "quark", "export": {"pack_method": "reorder", "kv_cache_group": []},
          "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                             "scale_format": "e8m0", "is_dynamic": False}},
          "layer_quant_config": {}, "exclude": ["lm_head"]}
    got = dict(open_checkpoint(write_dir(str(tmp_path), sd, TINY, qc)).iter_weights(progress=False))
    gate_up = got["model.layers.1.mlp.gate_up_proj"]
    assert isinstance(gate_up, Mxfp4Weight) and gate_up.partition_sizes == (96, 96)
    g, u = expected["model.layers.1.mlp.gate_proj"], expected["model.layers.1.mlp.up_proj"]
    assert torch.equal(gate_up.packed, torch.cat([g[0], u[0]])) and torch.equal(gate_up.scale, torch.cat([g[1], u[1]]))


def test_tied_embeddings_have_no_lm_head(tmp_path):
    config = dict(TINY, tie_word_embeddings=True)
    ckpt = open_checkpoint(write_dir(str(tmp_path), dense_state_dict(config), config))
    assert "lm_head.weight" not in ckpt.names() and "lm_head" not in ckpt.names()


def test_directory_with_one_gguf_and_missing_path(tmp_path):
    from radiance.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no such file"):
        open_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="neither config.json nor a .gguf"):
        open_checkpoint(str(tmp_path))
    assert os.path.isdir(tmp_path)


def test_qwen2_biases_are_merged_and_split_back(tmp_path):
    from radiance.checkpoint import convert_checkpoint
    from radiance.config import ConvertConfig

    sd = dense_state_dict()
    gen = torch.Generator().manual_seed(7)
    for i in range(2):
        for x, n in (("q", 64), ("k", 32), ("v", 32)):
            sd[f"model.layers.{i}.self_attn.{x}_proj.bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    qwen2 = dict(TINY, architectures=["Qwen2ForCausalLM"], model_type="qwen2")  # Llama has no q/k/v bias
    src = write_dir(str(tmp_path / "src"), sd, qwen2)
    got = open_checkpoint(src).state_dict()
    bias = got["model.layers.0.self_attn.qkv_proj.bias"]
    assert torch.equal(bias, torch.cat([sd[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert "model.layers.0.self_attn.q_proj.bias" not in got
    convert_checkpoint(src, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    again = open_checkpoint(str(tmp_path / "out"))
    assert torch.equal(again.state_dict()["model.layers.0.self_attn.qkv_proj.bias"], bias)
    assert "model.layers.0.self_attn.k_proj.bias" in again.index.meta


def test_fp8_per_tensor_scale_becomes_per_channel(tmp_path):
    from radiance.formats import Fp8Weight

    sd = dense_state_dict()
    m = "model.layers.0.mlp.down_proj"
    w = sd.pop(f"{m}.weight").float()
    scale = w.abs().max() / 448.0
    sd[f"{m}.weight"] = (w / scale).to(torch.float8_e4m3fn)
    sd[f"{m}.weight_scale"] = scale.reshape(1)
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": [m], "weights": {
              "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
    ckpt = open_checkpoint(write_dir(str(tmp_path), sd, TINY, qc))
    assert ckpt.warnings == []
    got = ckpt.state_dict()
    down = got[m]
    assert isinstance(down, Fp8Weight) and down.scale.shape == (64, 1) and bool((down.scale == scale).all())
    assert torch.equal(dequantize(down), sd[f"{m}.weight"].float() * scale)
    assert isinstance(got["model.layers.1.mlp.down_proj"], DenseWeight)  # only the exact target is fp8


def test_design_example_mtp_fc_weight_in_ignore(tmp_path):
    """DESIGN.md: `ignore: ["mtp.fc.weight"]` names a tensor; meant is the module `mtp.fc` (kept 16-bit)."""
    sd = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    gen = torch.Generator().manual_seed(5)
    sd["mtp.fc.weight"] = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    sd.update(ct_nvfp4_tensors({"mtp.proj.weight": torch.randn(64, 64, generator=gen)}, ["mtp.proj"]))
    qc = dict(CT_NVFP4_CONFIG, ignore=["lm_head", "mtp.fc.weight"])
    ckpt = open_checkpoint(write_dir(str(tmp_path), sd, TINY, qc))
    assert len(ckpt.warnings) == 1 and "'mtp.fc.weight' names a tensor" in ckpt.warnings[0]
    assert "write 'mtp.fc'" in ckpt.warnings[0]
    got = ckpt.state_dict()
    assert torch.equal(got["mtp.fc.weight"], sd["mtp.fc.weight"])
    assert isinstance(got["mtp.proj"], Nvfp4Weight)  # an unknown Linear still follows the "Linear" target


def test_calibrated_kv_scales_reach_the_attention_layers(tmp_path):
    """FP8-KV checkpoints carry one k_scale / v_scale per layer (compressed-tensors on self_attn, ModelOpt on
    k_proj / v_proj): the model loads with each layer's KvScales set (what an fp8 cache stores against) and
    a summary line; fp8-attention scales (q_scale) are named in one warning; a non-finite or non-positive
    scale names its tensor."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model
    from radiance.errors import CheckpointError
    from radiance.layers.attention import KvScales

    sd = dense_state_dict()
    layers = TINY["num_hidden_layers"]
    sd.update({f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.02 * (i + 1)) for i in range(layers)})
    sd.update({f"model.layers.{i}.self_attn.v_proj.v_scale": torch.tensor([0.5, 0.25]) for i in range(layers)})
    sd["model.layers.0.self_attn.q_scale"] = torch.tensor(0.1)
    path = write_dir(str(tmp_path / "kv"), sd, TINY)
    ckpt = open_checkpoint(path)
    [note] = ckpt.warnings
    assert "1 attention scale tensor" in note and "model.layers.0.self_attn.q_scale" in note
    assert ckpt.attention_scales["model.layers.1.self_attn.k_scale"] == pytest.approx(0.04)
    assert ckpt.attention_scales["model.layers.0.self_attn.v_scale"] == 0.5  # per head: the largest
    assert not any(n.endswith("_scale") for n in ckpt.names())
    from radiance.checkpoint.inspect import inspect_lines
    shown = "\n".join(inspect_lines(ckpt))
    assert f"fp8 KV-cache k_scale {layers:>5} layers, 0.02 .. {0.02 * layers:.4g}" in shown, shown
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False)
    got = [attn.fp8_kv_scales for attn in loaded.model.attention_layers()]
    assert all(isinstance(s, KvScales) for s in got)
    assert [(s.k, s.v) for s in got] == [(pytest.approx(0.02 * (i + 1)), 0.5) for i in range(layers)]
    assert any(line.startswith(f"fp8 KV-cache scales: {layers} of {layers} layers") for line in loaded.summary)

    for bad in (float("nan"), 0.0):
        sd["model.layers.0.self_attn.k_scale"] = torch.tensor(bad)
        path = write_dir(str(tmp_path / f"bad{bad}"), sd, TINY)
        with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_scale"):
            open_checkpoint(path)


def _modelopt_nvfp4_tensors(sd: dict, modules: list[str]) -> dict:
    """ModelOpt's NVFP4 layout of `modules`: codes under `weight`, e4m3 `weight_scale`, `weight_scale_2` (the
    reciprocal of compressed-tensors' global scale) and an unused activation `input_scale`."""
    out = ct_nvfp4_tensors(sd, modules)
    for m in modules:
        out[f"{m}.weight"] = out.pop(f"{m}.weight_packed")
        out[f"{m}.weight_scale_2"] = (1.0 / out.pop(f"{m}.weight_global_scale")).reshape(())
        out[f"{m}.input_scale"] = torch.tensor(0.05)
    return out


@pytest.mark.parametrize("config_file", ["config.json", "hf_quant_config.json"])
def test_modelopt_nvfp4_reads_as_compressed_tensors_does(tmp_path, config_file):
    """The same NVFP4 values in ModelOpt's layout (its quantization config in config.json, or in the
    hf_quant_config.json of older exports) read as the compressed-tensors checkpoint's weights."""
    sd = dense_state_dict()
    modules = [m for m in linear_modules() if not m.endswith("o_proj")]  # o_proj excluded, 16-bit
    ct = dict(open_checkpoint(write_dir(str(tmp_path / "ct"), ct_nvfp4_tensors(sd, modules), TINY,
                                        dict(CT_NVFP4_CONFIG, ignore=["lm_head", "re:.*o_proj"])))
              .iter_weights(progress=False))
    quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.o_proj"]}
    if config_file == "config.json":
        path = write_dir(str(tmp_path / "mo"), _modelopt_nvfp4_tensors(sd, modules), TINY,
                         {"quant_method": "modelopt", **quant})
    else:
        path = write_dir(str(tmp_path / "mo"), _modelopt_nvfp4_tensors(sd, modules), TINY)
        with open(os.path.join(path, "hf_quant_config.json"), "w") as handle:
            json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}, handle)
    ckpt = open_checkpoint(path)
    assert ckpt.quant.method == "modelopt" and not ckpt.warnings
    got = dict(ckpt.iter_weights(progress=False))
    assert got.keys() == ct.keys()
    qkv = got["model.layers.1.self_attn.qkv_proj"]
    assert isinstance(qkv, Nvfp4Weight) and qkv.partition_sizes == (64, 32, 32)
    for name, weight in got.items():  # the same codes and block scales; 1 / weight_scale_2 within an fp32 ulp
        if isinstance(weight, Nvfp4Weight):
            assert torch.equal(weight.packed, ct[name].packed) and torch.equal(weight.scale, ct[name].scale), name
            torch.testing.assert_close(dequantize(weight), dequantize(ct[name]), rtol=3e-7, atol=0)
    assert isinstance(got["model.layers.0.self_attn.o_proj"], DenseWeight)


def test_modelopt_bad_second_scale_is_named(tmp_path):
    from radiance.errors import CheckpointError

    sd = _modelopt_nvfp4_tensors(dense_state_dict(), linear_modules())
    sd["model.layers.1.mlp.up_proj.weight_scale_2"] = torch.tensor(0.0)
    path = write_dir(str(tmp_path), sd, TINY, {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                              "exclude_modules": ["lm_head"]})
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_scale_2"):
        dict(open_checkpoint(path).iter_weights(progress=False))


def test_modelopt_fp8_scalar_scales(tmp_path):
    """ModelOpt FP8: e4m3 `weight` with 0-d `weight_scale` and `input_scale` (the activation scale, unused) on every
    linear but the excluded ones."""
    from radiance.formats import Fp8Weight

    sd = dense_state_dict()
    scales = {}
    for m in linear_modules():
        w = sd.pop(f"{m}.weight").float()
        scales[m] = w.abs().max() / 448.0
        sd[f"{m}.weight"] = (w / scales[m]).to(torch.float8_e4m3fn)
        sd[f"{m}.weight_scale"] = scales[m].reshape(())
        sd[f"{m}.input_scale"] = torch.tensor(0.02)
    ckpt = open_checkpoint(write_dir(str(tmp_path), sd, TINY, {"quant_method": "modelopt", "quant_algo": "FP8",
                                                              "exclude_modules": ["lm_head"]}))
    assert ckpt.warnings == []
    got = ckpt.state_dict()
    gate_up = got["model.layers.0.mlp.gate_up_proj"]
    assert isinstance(gate_up, Fp8Weight) and gate_up.scale.shape == (192, 1)
    m = "model.layers.1.self_attn.o_proj"
    assert torch.equal(dequantize(got[m]), sd[f"{m}.weight"].float() * scales[m])


@pytest.mark.parametrize("extra", ["model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"])
def test_a_merged_linear_stored_beside_its_parts_is_refused(tmp_path, extra):
    """q_proj / k_proj / v_proj and a qkv_proj too (a half-merged export): one would be served, the other ignored
    without a word; refused at open naming the tensor."""
    from radiance.errors import CheckpointError

    sd = dense_state_dict()
    parts = ("q", "k", "v") if "qkv" in extra else ("gate", "up")
    prefix = extra.rsplit(".", 2)[0]
    sd[extra] = torch.cat([sd[f"{prefix}.{p}_proj.weight"] for p in parts])
    path = write_dir(str(tmp_path / "both"), sd, TINY)
    with pytest.raises(CheckpointError, match=r"stored both whole and as its parts") as info:
        open_checkpoint(path)
    assert prefix in str(info.value)
