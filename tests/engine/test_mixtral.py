"""Mixtral (MixtralForCausalLM) as transformers reads it: every MLP sparse over `intermediate_size` experts, the
router's softmax top-k renormalized, `block_sparse_moe` / w1 w3 w2 read as the sparse MLP's gate / up / down, the
window on every layer; quantized at load and converted to MXFP4 on disk."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.hf_config import mixtral_tensor
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers

SIZES = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 16, "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2}


def test_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(SIZES)
    assert cls.__name__ == "MixtralForCausalLM"
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2 and cfg.moe.intermediate_size == 96
    assert cfg.moe.norm_topk_prob and cfg.moe.layers == {0, 1} and cfg.moe.shared_expert_size == 0
    assert cfg.num_kv_heads == 8 and cfg.rope_theta == 1e6 and cfg.sliding_window is None  # MixtralConfig defaults
    windowed = resolve_architecture(dict(SIZES, sliding_window=4096, layer_types=["full_attention"] * 2))[1]
    assert windowed.sliding_layers == {0, 1}  # every layer, layer_types unread
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        resolve_architecture(dict(SIZES, num_experts_per_tok=9))


def test_tensor_names_read_as_the_sparse_mlp_names_them():
    assert mixtral_tensor("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert mixtral_tensor("model.layers.0.block_sparse_moe.experts.7.w1.weight") == \
        "model.layers.0.mlp.experts.7.gate_proj.weight"
    assert mixtral_tensor("model.layers.0.block_sparse_moe.experts.7.w3.weight_scale") == \
        "model.layers.0.mlp.experts.7.up_proj.weight_scale"
    assert mixtral_tensor("model.layers.0.block_sparse_moe.experts.12.w2.weight") == \
        "model.layers.0.mlp.experts.12.down_proj.weight"
    assert mixtral_tensor("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("mixtral"), prompt_len=36, chunk=chunk)


def test_mxfp4_at_load_and_converted_on_disk_serve_the_same_logits(tiny_model_dir, tmp_path):
    """Every expert linear on MXFP4 (quantized at load) and the same logits, bit for bit, from the checkpoint
    `radiance convert` wrote (renamed to the sparse MLP's names, which it reads back as they are)."""
    path, _ = tiny_model_dir("mixtral")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "linears: 36 mxfp4" in "\n".join(loaded.summary)  # 2 layers x (8 experts x 2 + qkv + o)
    at_load = loaded.model.forward_logits(ids)
    convert_checkpoint(path, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    converted = load_model(ModelConfig(device="cpu", dtype="bfloat16"), checkpoint=open_checkpoint(str(tmp_path / "mx")),
                           progress=False).model.forward_logits(ids)
    assert torch.equal(at_load, converted)
