"""Phi-3 GGUF files as llama.cpp's converter writes them: merged attn_qkv and ffn_up (gate | up) read as the merged
linears they are, the window from attention.sliding_window, LongRoPE's factor sets from their tensors with the
attention factor and pretraining context from the metadata, a partial rotary from rope.dimension_count: the logits
transformers gives the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from radiance.models.registry import resolve_architecture

BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
         "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_of(hf, path, drop: str | None = None) -> str:
    """The tiny HF Phi-3 as llama.cpp's Phi3MiniModel converter writes it (float32 tensors); `drop`: a tensor left
    out."""
    import gguf
    import numpy as np

    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    tensors = {}
    if rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        original = c.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for name, tensor in hf.state_dict().items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            tensors[f"blk.{i}.{BLOCK[module]}.{leaf}"] = tensor.float().numpy()
        else:
            tensors[TOP[name]] = tensor.float().numpy()
    for name, values in tensors.items():
        if name != drop:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _assert_logits_match(hf, ckpt, tokens: int) -> None:
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5


def test_a_phi3_gguf_with_its_window(tiny_model_dir, tmp_path):
    _, hf = tiny_model_dir("phi3")
    ckpt = open_checkpoint(gguf_of(hf, tmp_path / "p.gguf"))
    assert ckpt.architecture == "Phi3ForCausalLM"
    _, cfg = resolve_architecture(ckpt.config)
    assert cfg.sliding_window == 20 and cfg.sliding_layers == {0, 1} and cfg.rope_scaling is None
    _assert_logits_match(hf, ckpt, tokens=50)  # past the window


def test_a_phi4_mini_shaped_gguf_with_longrope_and_a_partial_rotary(tiny_model_dir, tmp_path):
    """The factor tensors become the config's LongRoPE (not weights the model lacks); 40 tokens pass the 32-token
    pretraining context, where transformers and radiance's default (the model's whole context) both take the long
    factors."""
    _, hf = tiny_model_dir("phi3longrope")
    ckpt = open_checkpoint(gguf_of(hf, tmp_path / "l.gguf"))
    _, cfg = resolve_architecture(ckpt.config)
    assert cfg.rotary_dim == 12 and cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert cfg.rope_scaling["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"])
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(32)))
    _assert_logits_match(hf, ckpt, tokens=40)


def test_one_longrope_factor_set_alone_is_refused(tiny_model_dir, tmp_path):
    _, hf = tiny_model_dir("phi3longrope")
    with pytest.raises(CheckpointError, match="has rope_factors_long.weight but not rope_factors_short.weight"):
        open_checkpoint(gguf_of(hf, tmp_path / "one.gguf", drop="rope_factors_short.weight"))
