"""Granite (GraniteForCausalLM) as transformers computes it: embedding, attention and residual multipliers and the
logits' divisor, the residual multiplier folded into o_proj / down_proj (and o_proj's bias) at load."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError, ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers
from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf

SIZES = {"model_type": "granite", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 100}


def test_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(dict(SIZES, embedding_multiplier=12, attention_multiplier=0.015625,
                                         residual_multiplier=0.22, logits_scaling=8))
    assert cls.__name__ == "GraniteForCausalLM"
    multipliers = (cfg.embed_scale, cfg.attention_scale, cfg.residual_multiplier, cfg.logits_scaling)
    assert multipliers == (12, 0.015625, 0.22, 8)
    assert not cfg.embed_scale_rounded
    plain = resolve_architecture(SIZES)[1]  # GraniteConfig's defaults: every multiplier 1 (the attention's too)
    assert (plain.embed_scale, plain.attention_scale, plain.residual_multiplier, plain.logits_scaling) == (1, 1, 1, 1)
    for key, value in (("residual_multiplier", 0), ("logits_scaling", "8"), ("embedding_multiplier", True)):
        with pytest.raises(ConfigError, match=key):
            resolve_architecture(dict(SIZES, **{key: value}))


@pytest.mark.parametrize("chunk", [None, 16])
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("granite"), prompt_len=30, chunk=chunk)


def test_quantized_at_load_the_folded_weights_stay_near_the_reference(tiny_model_dir):
    """MXFP4 at load quantizes the already-scaled o_proj / down_proj: logits as near transformers' as the other
    models' MXFP4 logits are (the multiplier itself is not rounded into a power of two)."""
    path, hf = tiny_model_dir("granite")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4"),
                      checkpoint=open_checkpoint(path), progress=False).model.forward_logits(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.15


def test_an_mxfp4_checkpoint_takes_a_power_of_two_multiplier_only(tiny_model_dir, tmp_path):
    """Its e8m0 block scales cannot hold 0.22: refused naming the tensor; a multiplier of 0.25 loads, to exactly the
    logits of the 16-bit checkpoint with that multiplier quantized at load."""
    path, _ = tiny_model_dir("granite")
    converted = tmp_path / "mxfp4"
    convert_checkpoint(path, str(converted), ConvertConfig(format="mxfp4"), progress=False)
    with pytest.raises(CheckpointError, match=r"residual_multiplier 0.22 .*power of two.*tensor model\.layers\.0\."):
        load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(converted)),
                   progress=False)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    logits = []
    for source, options in ((str(converted), {}), (path, {"quantization": "mxfp4"})):  # served as stored; at load
        ckpt = open_checkpoint(source)
        ckpt.config = dict(ckpt.config, residual_multiplier=0.25)
        logits.append(load_model(ModelConfig(device="cpu", dtype="bfloat16", **options), checkpoint=ckpt,
                                 progress=False).model.forward_logits(ids))
    assert torch.equal(*logits)  # 0.25 moves the block exponents: the codes quantizing 0.25 x W at load gives


def test_a_granite_gguf_as_llama_cpp_writes_it(tiny_model_dir, tmp_path):
    """llama.cpp's Granite file (Llama's converter: q / k rows permuted; the multipliers as attention.scale,
    embedding_scale, residual_scale, logit_scale): transformers' logits for the same weights."""
    _, hf = tiny_model_dir("granite")
    c = hf.config
    scales = {"granite.attention.scale": c.attention_multiplier, "granite.embedding_scale": c.embedding_multiplier,
              "granite.residual_scale": c.residual_multiplier, "granite.logit_scale": c.logits_scaling}
    write_gguf(tmp_path / "g.gguf", "granite", c, gguf_tensors(hf, LLAMA_BLOCK, permute=True),
               {key: float(value) for key, value in scales.items()})
    ckpt = open_checkpoint(str(tmp_path / "g.gguf"))
    assert resolve_architecture(ckpt.config)[1].residual_multiplier == pytest.approx(0.22)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5
