"""Phi-3 GGUF files as llama.cpp's converter writes them: merged attn_qkv and ffn_up (gate | up) read as the merged
linears they are, the window from attention.sliding_window, LongRoPE's factor sets from their tensors with the
attention factor and pretraining context from the metadata, a partial rotary from rope.dimension_count: the logits
transformers gives the same weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from radiance.models.registry import resolve_architecture
from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf

# llama.cpp keeps Phi-3's merged projections
BLOCK = {**LLAMA_BLOCK, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def gguf_of(hf, path, drop: str | None = None) -> str:
    """The tiny HF Phi-3 as llama.cpp's Phi3MiniModel converter writes it (float32 tensors); `drop`: a tensor left
    out."""
    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    metadata = {"phi3.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
                "phi3.rope.scaling.original_context_length": c.original_max_position_embeddings}
    if c.sliding_window:
        metadata["phi3.attention.sliding_window"] = c.sliding_window
    tensors = gguf_tensors(hf, BLOCK)
    if rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        metadata["phi3.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(
            c.original_max_position_embeddings))
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return write_gguf(path, "phi3", c, {k: v for k, v in tensors.items() if k != drop}, metadata)


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
