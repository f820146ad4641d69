"""Phi-3 (Phi3ForCausalLM: Phi-3-mini / medium, Phi-4) as transformers reads it: the Llama decoder without biases,
q/k/v and gate/up stored merged, a sliding window on every layer when config.json gives one; LongRoPE and a
partial rotary refused before any load."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.inspect import inspect_lines
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers, assert_window_changes_logits

SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 16,
         "vocab_size": 100}


def _arch(**config):
    return resolve_architecture({"architectures": ["Phi3ForCausalLM"], **SIZES, **config})[1]


def test_config_as_transformers_reads_it():
    plain = _arch()
    assert plain.sliding_layers == frozenset() and plain.sliding_window is None  # Phi3Config: no window
    assert plain.num_kv_heads == 16 and plain.max_position_embeddings == 4096 and plain.rms_norm_eps == 1e-5
    windowed = _arch(sliding_window=2047, layer_types=["full_attention"] * 3, attention_bias=True)  # both unread
    assert windowed.sliding_window == 2047 and windowed.sliding_layers == {0, 1, 2}
    assert not windowed.qkv_bias and not windowed.o_bias
    assert resolve_architecture({"model_type": "phi3", **SIZES})[0].__name__ == "Phi3ForCausalLM"


@pytest.mark.parametrize("config, refusal", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 2, "long_factor": [4.0] * 2,
                       "original_max_position_embeddings": 4096}}, "longrope"),  # Phi-3.5-mini, the 128k models
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini
])
def test_what_radiance_cannot_rotate_is_refused_in_one_line(config, refusal):
    with pytest.raises(ConfigError, match=refusal):
        _arch(**config)


def test_merged_checkpoint_linears_load_as_they_are(tiny_model_dir):
    """The checkpoint stores qkv_proj and gate_up_proj whole: `inspect` lists them as servable linears, and
    converting to MXFP4 on disk serves the logits that quantizing at load does."""
    path, _ = tiny_model_dir("phi3")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    lines = "\n".join(inspect_lines(open_checkpoint(path)))
    assert re.search(r"^  qkv_proj +2 +dense +\[128, 64\]", lines, re.M) and re.search(r"^  gate_up_proj +2 ", lines, re.M)
    assert re.search(r"^servable +yes$", lines, re.M)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    at_load = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),  # convert writes bf16
                         checkpoint=open_checkpoint(path), progress=False).model.forward_logits(ids)
    converted_dir = path + "-mxfp4"
    convert_checkpoint(path, converted_dir, ConvertConfig(format="mxfp4"), progress=False)
    converted = load_model(ModelConfig(device="cpu", dtype="bfloat16"), checkpoint=open_checkpoint(converted_dir),
                           progress=False).model.forward_logits(ids)
    assert torch.equal(at_load, converted)


def split_as_mistral(path: str, dst) -> str:
    """The Phi-3 checkpoint at `path` rewritten as the Mistral checkpoint it equals: q/k/v and gate/up stored
    apart, the same window on every layer (no biases in either)."""
    import json
    import shutil

    config = json.loads(open(f"{path}/config.json").read())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    tensors = {}
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith("qkv_proj.weight"):
                parts = t.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
                tensors.update({name.replace("qkv_proj", p): w.contiguous() for p, w in zip(("q_proj", "k_proj", "v_proj"), parts)})
            elif name.endswith("gate_up_proj.weight"):
                gate, up = t.chunk(2)
                tensors.update({name.replace("gate_up_proj", "gate_proj"): gate.contiguous(),
                                name.replace("gate_up_proj", "up_proj"): up.contiguous()})
            else:
                tensors[name] = t
    shutil.copytree(path, dst)
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    open(f"{dst}/config.json", "w").write(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_merged_storage_serves_what_split_storage_does(tiny_model_dir, tmp_path, quantization):
    """The same weights stored merged (Phi-3) and apart (as Mistral) load to bit-identical logits, quantized or not."""
    path, _ = tiny_model_dir("phi3")
    split = split_as_mistral(path, tmp_path / "split")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    config = ModelConfig(device="cpu", dtype="bfloat16", quantization=quantization)
    logits = [load_model(config, checkpoint=open_checkpoint(p), progress=False).model.forward_logits(ids)
              for p in (path, split)]
    assert torch.equal(*logits)


def test_the_window_is_applied(tiny_model_dir):
    assert_window_changes_logits(tiny_model_dir("phi3")[0], window=20, tokens=50)


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("phi3"), prompt_len=36, chunk=chunk, low=3)
