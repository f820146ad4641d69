"""config.json read as transformers reads it: the keys a config may leave out get transformers' per-architecture
defaults, Qwen sliding windows come from use_sliding_window / max_window_layers, and a null or mistyped size is
a ConfigError of one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import tiny_hf_model

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _config(model_type: str, **extra) -> dict:
    config = dict(SMALL, architectures=[ARCHS[model_type]], model_type=model_type, **extra)
    if model_type.endswith("moe") or model_type == "gpt_oss":
        config.update(MOE)
    return config


def _transformers_config(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})


def _transformers_windows(hf) -> list[int | None]:
    """The window each attention layer of the transformers model gets (modeling_<arch>.py's rule)."""
    window = hf.sliding_window or None  # Qwen2-MoE switches it off as 0, the others as None
    if hf.model_type == "qwen3_moe":  # no layer_types: config.sliding_window on every layer
        return [window] * hf.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in hf.layer_types]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("extra", [
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},  # was refused (no layer_types)
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 5},
    {"use_sliding_window": True, "max_window_layers": 3},  # transformers' default window, 4096
    {"use_sliding_window": True, "sliding_window": 16},  # transformers' default max_window_layers, 28
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 2},
    {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 2},
    # was: a window on layers 0 and 3, though use_sliding_window false switches it off in transformers
    {"use_sliding_window": False, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention",
                                                                        "full_attention"] * 2},
    {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention",
                                                                       "full_attention"] * 2},
])
def test_qwen_sliding_windows_match_transformers(model_type, extra):
    config = _config(model_type, **extra)
    cfg = resolve_architecture(config)[1]
    want = _transformers_windows(_transformers_config(config))
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == want


def test_llama_has_no_sliding_window():
    """transformers' Llama reads no sliding_window: a stray one must not narrow attention."""
    config = _config("llama", sliding_window=16, use_sliding_window=True, layer_types=["sliding_attention"] * 6)
    assert [resolve_architecture(config)[1].window_of(i) for i in range(6)] == [None] * 6


@pytest.mark.parametrize("extra, message", [
    ({"sliding_window": 16, "layer_types": ["sliding_attention"] * 4}, "4 layer_types for 6 layers"),
    ({"sliding_window": "16"}, "'sliding_window' must be a positive integer, got '16'"),
    ({"sliding_window": 16, "max_window_layers": "2"}, "'max_window_layers' must be a layer count, got '2'"),
])
def test_a_qwen_window_config_that_cannot_be_read_is_one_line(extra, message):
    with pytest.raises(ConfigError, match=message):
        resolve_architecture(_config("qwen2", use_sliding_window=True, **extra))


def test_tiny_qwen2_with_derived_sliding_layers_matches_transformers(tmp_path):
    """A Qwen2 config that switches the window on without layer_types (as transformers < 4.53 wrote them):
    layer 1 slides (max_window_layers 1), over 300 tokens against a 32-token window."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=32, max_window_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.pop("layer_types"))
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(tmp_path)),
                        progress=False)
    assert [loaded.model.config.window_of(i) for i in range(2)] == [None, 32]
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = loaded.model.forward_logits(ids)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-3


def _edit_config(path, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as handle:
        config = json.load(handle)
    edit(config)
    with open(file, "w") as handle:
        json.dump(config, handle)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_defaults_of_a_bare_config_are_transformers(model_type):
    """A config.json with only the sizes: head_dim (Qwen3 128, gpt-oss 64), rms_norm_eps (gpt-oss 1e-5),
    max_position_embeddings, rope_theta (gpt-oss 150000) and rope scaling (gpt-oss YaRN) as transformers has
    them. Was: hidden_size // heads, 1e-6, 4096, 10000 and none for every architecture."""
    config = _config(model_type)
    cfg = resolve_architecture(config)[1]
    hf = _transformers_config(config)
    rope = dict(hf.rope_parameters)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rope_theta == rope.pop("rope_theta")
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    assert {k: v for k, v in (cfg.rope_scaling or {}).items() if k != "rope_type"} == \
        {k: v for k, v in rope.items() if k != "rope_type"}
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize("model_type, extra, qkv_bias, o_bias", [
    ("gpt_oss", {}, True, True),
    ("gpt_oss", {"attention_bias": False}, False, False),  # was: biases the checkpoint does not have
    ("qwen2", {"attention_bias": False}, True, False),  # transformers' Qwen2 always has them
    ("qwen2_moe", {}, True, False),
    ("qwen2_moe", {"qkv_bias": False}, False, False),  # was: biases the checkpoint does not have
    ("qwen3", {"attention_bias": True}, True, True),
    ("llama", {"attention_bias": True}, True, True),
])
def test_attention_biases_follow_transformers(model_type, extra, qkv_bias, o_bias):
    cfg = resolve_architecture(_config(model_type, **extra))[1]
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv_bias, o_bias)


def test_mlp_bias_is_refused_only_where_it_is_read():
    """transformers' Llama reads mlp_bias; the Qwen models ignore it (was: a Qwen2 config refused for it)."""
    assert resolve_architecture(_config("qwen2", mlp_bias=True))[1].architecture == "Qwen2ForCausalLM"
    with pytest.raises(ConfigError, match="mlp_bias"):
        resolve_architecture(_config("llama", mlp_bias=True))


@pytest.mark.parametrize("key, value, message", [
    ("rope_theta", None, None),  # was: TypeError (float(None)); a null is the default
    ("rope_theta", "1e6", "'rope_theta' must be a positive number, got '1e6'"),
    ("rms_norm_eps", "1e-6", "'rms_norm_eps' must be a positive number, got '1e-6'"),
    ("rms_norm_eps", None, None),
    ("max_position_embeddings", None, None),  # was: None handed to the rotary table
    ("max_position_embeddings", 4096.5, "'max_position_embeddings' must be a positive integer, got 4096.5"),
])
def test_null_or_mistyped_numbers(key, value, message):
    config = _config("qwen3", **{key: value})
    if message is None:
        cfg = resolve_architecture(config)[1]
        assert getattr(cfg, key) == getattr(resolve_architecture(_config("qwen3"))[1], key)
    else:
        with pytest.raises(ConfigError, match=message):
            resolve_architecture(config)


def test_qwen3_without_head_dim_loads_with_its_default(tmp_path):
    """transformers' Qwen3 takes head_dim 128 when config.json gives none (not hidden_size // heads = 16 here).
    Was: open_checkpoint refused q_proj's shape (512, 64) as wrong."""
    hf = tiny_hf_model("qwen3")
    hf.config.head_dim = 128
    hf = type(hf)(hf.config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.05)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.pop("head_dim"))
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(tmp_path)),
                        progress=False)
    assert loaded.model.config.head_dim == 128
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert ((loaded.model.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-3


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_kv_heads_of_a_config_without_them_are_transformers(model_type):
    """An absent num_key_value_heads is the architecture's default in transformers (Qwen2 32, Qwen3-MoE 4,
    gpt-oss 8; Llama one per head). Was: one per head for all."""
    config = dict(_config(model_type), num_attention_heads=64, hidden_size=512)
    del config["num_key_value_heads"]
    assert resolve_architecture(config)[1].num_kv_heads == _transformers_config(config).num_key_value_heads


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_null_kv_heads_are_one_per_head(model_type):
    """As transformers' Llama, Qwen2 and Qwen3 read it (its MoE and gpt-oss configs refuse a null)."""
    config = dict(_config(model_type), num_attention_heads=64, hidden_size=512, num_key_value_heads=None)
    assert resolve_architecture(config)[1].num_kv_heads == 64


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"type": "linear", "factor": 2.0},
])
def test_a_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(scaling):
    """A config with both (a user's YaRN rope_scaling added to a transformers 5 config): transformers reads
    rope_scaling in place of rope_parameters, rope_theta then from the top level or its default; radiance ignored
    rope_scaling."""
    config = _config("qwen3", max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=scaling)
    cfg = resolve_architecture(config)[1]
    hf = _transformers_config(config)
    rope = dict(hf.rope_parameters)
    assert cfg.rope_theta == rope.pop("rope_theta")
    kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    assert kind == rope["rope_type"] == scaling.get("rope_type", scaling.get("type"))
    assert cfg.rope_scaling["factor"] == rope["factor"]


def test_an_unknown_rope_scaling_beside_rope_parameters_is_refused():
    config = _config("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     rope_scaling={"rope_type": "bogus", "factor": 2.0})
    with pytest.raises(ConfigError, match="'bogus' is not supported"):
        resolve_architecture(config)


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


@pytest.mark.parametrize("model_type, extra", [
    # transformers 5 writes both, equal, the base inside only: it stays 500000 (a first fix read 10000)
    ("llama", {"rope_parameters": _LLAMA31_ROPE, "rope_scaling": _LLAMA31_ROPE}),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
               "rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}}),
    # Gemma 3: a flat rope_scaling beside per layer type rope_parameters scales the full-attention layers
    ("gemma3_text", {"head_dim": 16, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
])
def test_both_rope_keys_give_transformers_base_and_scaling(model_type, extra):
    arch = {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[model_type]
    config = dict(SMALL, architectures=[arch], model_type=model_type, max_position_embeddings=131072, **extra)
    cfg = resolve_architecture(config)[1]
    hf_rope = dict(_transformers_config(config).rope_parameters)
    hf_rope = hf_rope.get("full_attention", hf_rope)
    assert cfg.rope_theta == hf_rope["rope_theta"]
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == hf_rope["rope_type"]
    assert (cfg.rope_scaling or {}).get("factor") == hf_rope.get("factor")


def test_a_partial_rotary_factor_of_replaced_rope_parameters_is_not_read():
    """transformers drops rope_parameters (its partial_rotary_factor too) when a rope_scaling replaces it."""
    from radiance.models.rope_config import rotary_dim_of

    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert rotary_dim_of(config, "Phi3ForCausalLM", 16) is None
    assert rotary_dim_of({"rope_parameters": config["rope_parameters"]}, "Phi3ForCausalLM", 16) == 12
