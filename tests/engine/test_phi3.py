"""Phi-3 (Phi3ForCausalLM: Phi-3-mini / medium, Phi-3.5-mini, Phi-4, Phi-4-mini) as transformers reads it: the Llama
decoder without biases, q/k/v and gate/up stored merged, a sliding window on every layer when config.json gives one,
LongRoPE with its short or long factors chosen by the served context, a partial rotary."""

from __future__ import annotations

import math
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


# as Phi-3.5-mini spells it (one factor per frequency: head_dim 4 here)
PHI35_ROPE = {"type": "longrope", "short_factor": [1.0, 1.2], "long_factor": [4.0, 9.0]}


def test_longrope_as_transformers_reads_it():
    """Phi-3.5-mini's config: no original_max_position_embeddings in rope_scaling (the top level's, Phi3Config's 4096
    when absent), no factor (max_position_embeddings / original), the attention factor from them; older "su" and
    "yarn" spellings are LongRoPE in Phi-3."""
    arch = _arch(rope_scaling=PHI35_ROPE, max_position_embeddings=131072)
    scaling = arch.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert arch.context_length == 131072 and arch.rotary_dim is None
    given = _arch(rope_scaling=dict(PHI35_ROPE, original_max_position_embeddings=99, attention_factor=1.5),
                  original_max_position_embeddings=8192, max_position_embeddings=131072)
    assert given.rope_scaling["original_max_position_embeddings"] == 8192  # the top level wins, as in transformers
    assert given.rope_scaling["attention_factor"] == 1.5
    for old in ("su", "yarn"):
        assert _arch(rope_scaling=dict(PHI35_ROPE, type=old)).rope_scaling["rope_type"] == "longrope"
    assert _arch(rope_scaling=PHI35_ROPE).rope_scaling["attention_factor"] == 1.0  # no extension: no scaling


def test_partial_rotary_as_transformers_reads_it():
    """Phi-4-mini: partial_rotary_factor 0.75 of head_dim 128 rotates 96 dims (at the top level or, as transformers 5
    writes it, in rope_parameters); other architectures refuse it (their transformers model rotates whole heads)."""
    sizes = {"hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8}
    assert _arch(**sizes, partial_rotary_factor=0.75).rotary_dim == 96
    assert _arch(**sizes, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.75}).rotary_dim == 96
    assert _arch(partial_rotary_factor=1.0).rotary_dim is None
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 is not supported for LlamaForCausalLM"):
        resolve_architecture({"architectures": ["LlamaForCausalLM"], **SIZES, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("config, refusal", [
    ({"rope_scaling": dict(PHI35_ROPE, long_factor=[4.0] * 3)}, "'long_factor': a list of 2 positive numbers"),
    ({"rope_scaling": dict(PHI35_ROPE, short_factor=None)}, "'short_factor'"),
    ({"rope_scaling": dict(PHI35_ROPE, short_factor=[1.0, 0.0])}, "'short_factor'"),
    ({"partial_rotary_factor": 0.1}, "rotates 0 dims"),
    ({"partial_rotary_factor": 1.5}, r"in \(0, 1\]"),
])
def test_bad_rotary_settings_are_refused_in_one_line(config, refusal):
    with pytest.raises(ConfigError, match=refusal):
        _arch(**config)


@pytest.mark.parametrize("max_model_len, prompt_len, new_tokens", [
    (32, 10, 20),    # within the 32-token pretraining context: the short factors, as transformers there
    (None, 40, 24),  # the model's 512: the long factors, as transformers past 32 tokens
])
def test_longrope_partial_rotary_greedy_tokens_match_transformers(tiny_model_dir, max_model_len, prompt_len,
                                                                   new_tokens):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("phi3longrope"), prompt_len=prompt_len, chunk=None,
                                              new_tokens=new_tokens, max_model_len=max_model_len)


def test_served_context_picks_the_longrope_factors(tiny_model_dir):
    """The runner tells the rotary its max_model_len: the two factor sets give other logits (so the matches above
    depend on the choice), and switching back restores the first bit for bit."""
    from radiance import LLM

    path, _ = tiny_model_dir("phi3longrope")
    short = LLM(path, device="cpu", dtype="float32", max_model_len=32).engine.runner.model
    assert short.model.rotary.long_factors is False
    model = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path),
                       progress=False).model
    assert model.model.rotary.long_factors is True  # the whole 512-token context until a runner says otherwise
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    long_logits = model.forward_logits(ids)
    model.model.rotary.serve_context(32)
    short_logits = model.forward_logits(ids)
    assert torch.equal(short_logits, short.forward_logits(ids))
    assert ((short_logits - long_logits).norm() / long_logits.norm()).item() > 1e-2
    model.model.rotary.serve_context(33)
    assert torch.equal(model.forward_logits(ids), long_logits)


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
