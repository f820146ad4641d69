"""Llama 4 (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration) as transformers computes
it: chunked attention on the rotating layers, NoPE layers with the query temperature, weightless q / k norms,
interleaved rotary pairs (q / k rows reordered at load), sparse layers whose one expert takes its input times the
router's sigmoid score, an ungated shared expert, dense layers of intermediate_size_mlp; stacked 16-bit experts and
per-expert checkpoints; quantized at load."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.hf_config import llama4_tensor
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.formats import DenseWeight, Mxfp4Weight, Nvfp4Weight, dequantize, quantize_nvfp4, rows_reordered
from radiance.formats.mxfp4 import quantize_mxfp4
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers

SIZES = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 48,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 1}


def test_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(SIZES)
    assert cls.__name__ == "Llama4ForCausalLM"
    assert cfg.nope_layers == {3, 7} and cfg.chunked_layers == {0, 1, 2, 4, 5, 6} and cfg.attention_chunk == 8192
    assert cfg.qk_norm and cfg.query_temperature == (8192.0, 0.1) and cfg.rope_theta == 500000.0
    assert cfg.intermediate_size == 48 and cfg.moe.intermediate_size == 32 and cfg.moe.shared_expert_size == 32
    assert cfg.moe.layers == set(range(8)) and cfg.moe.scores_scale_input and not cfg.moe.shared_expert_gated
    maverick = resolve_architecture(dict(SIZES, interleave_moe_layer_step=2, use_qk_norm=False,
                                         attention_chunk_size=None, attn_temperature_tuning=False))[1]
    assert maverick.moe.layers == {1, 3, 5, 7} and not maverick.qk_norm
    assert maverick.chunked_layers == frozenset() and maverick.query_temperature is None
    typed = resolve_architecture(dict(SIZES, layer_types=["full_attention"] * 7 + ["chunked_attention"]))[1]
    assert typed.chunked_layers == {7}
    with pytest.raises(ConfigError, match="num_experts_per_tok=2"):
        resolve_architecture(dict(SIZES, num_experts_per_tok=2))
    with pytest.raises(ConfigError, match="layer_types"):
        resolve_architecture(dict(SIZES, layer_types=["sliding_attention"] * 8))


def test_tensor_names_read_as_the_decoder_names_them():
    assert llama4_tensor("model.layers.3.feed_forward.router.weight") == "model.layers.3.mlp.gate.weight"
    assert llama4_tensor("model.layers.3.feed_forward.experts.gate_up_proj") == "model.layers.3.mlp.experts.gate_up_proj"
    assert llama4_tensor("model.layers.0.feed_forward.shared_expert.up_proj.weight_scale") == \
        "model.layers.0.mlp.shared_expert.up_proj.weight_scale"
    assert llama4_tensor("model.layers.2.self_attn.k_proj.weight") == "model.layers.2.self_attn.k_proj.weight"


@pytest.mark.parametrize("chunk", [None, 7])  # one prefill, or pieces that start mid-chunk
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    """40 prompt tokens span three 16-token attention chunks and pass the NoPE layers' temperature step (8)."""
    assert_engine_greedy_matches_transformers(*tiny_model_dir("llama4"), prompt_len=40, chunk=chunk)


def test_logits_match_transformers_and_depend_on_each_feature(tiny_model_dir):
    """forward_logits equals transformers' within float32 rounding; dropping the chunks or the temperature changes
    the logits past them, so the match depends on both."""
    path, hf = tiny_model_dir("llama4")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
    ckpt = open_checkpoint(path)
    got = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model.forward_logits(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for change in ({"attention_chunk_size": None}, {"attn_temperature_tuning": False}):
        ckpt.config = dict(open_checkpoint(path).config, **change)
        other = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt,
                           progress=False).model.forward_logits(ids)
        assert torch.equal(other[:, :7], got[:, :7])  # the first chunk, below the temperature step: the same
        assert ((other[:, 16:] - got[:, 16:]).norm() / got[:, 16:].norm()).item() > 1e-3


def _per_expert_copy(path: str, out) -> str:
    """The checkpoint with its stacked experts written one linear each, as llm-compressor saves Llama 4 (gate_proj,
    up_proj, down_proj per expert, [out, in])."""
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    split = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].t().chunk(2)
                split[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                split[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                split[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].t().contiguous()
        else:
            split[name] = t
    out.mkdir()
    save_file(split, str(out / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (out / "config.json").write_text(f.read())
    return str(out)


def test_per_expert_checkpoint_serves_the_same_logits(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama4")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    stacked = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path),
                         progress=False).model.forward_logits(ids)
    split = _per_expert_copy(path, tmp_path / "split")
    per_expert = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(split),
                            progress=False).model.forward_logits(ids)
    assert torch.equal(stacked, per_expert)


def test_vision_language_wrapper_serves_its_language_model(tiny_model_dir, tmp_path):
    """Llama4ForConditionalGeneration's text_config and `language_model.` tensors: the same logits as the text model."""
    path, _ = tiny_model_dir("llama4")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    wrapped = {("language_model." + name): t for name, t in tensors.items()}
    wrapped["vision_model.patch_embedding.weight"] = torch.zeros(4, 4)
    out = tmp_path / "vlm"
    out.mkdir()
    save_file(wrapped, str(out / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    (out / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                                 "model_type": "llama4", "text_config": text,
                                                 "vision_config": {"hidden_size": 4}}))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    want = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path),
                      progress=False).model.forward_logits(ids)
    got = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(out)),
                     progress=False).model.forward_logits(ids)
    assert torch.equal(got, want)


def test_mxfp4_at_load_and_converted_on_disk_serve_the_same_logits(tiny_model_dir, tmp_path):
    """Every linear on MXFP4 (quantized at load), and the same logits, bit for bit, from the checkpoint `radiance
    convert` wrote (its q / k rows still interleaved on disk: reordered once, at load)."""
    path, _ = tiny_model_dir("llama4")
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    # 4 layers x (qkv + o) + 2 dense x (gate_up + down) + 2 sparse x (4 experts + shared) x 2
    assert "linears: 32 mxfp4" in "\n".join(loaded.summary)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    at_load = loaded.model.forward_logits(ids)
    convert_checkpoint(path, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    converted = load_model(ModelConfig(device="cpu", dtype="bfloat16"), checkpoint=open_checkpoint(str(tmp_path / "mx")),
                           progress=False).model.forward_logits(ids)
    assert torch.equal(at_load, converted)


@pytest.mark.parametrize("make", ["dense", "mxfp4", "nvfp4"])
def test_rows_reordered_moves_codes_and_scales_with_their_rows(make):
    torch.manual_seed(0)
    values = torch.randn(12, 64)
    if make == "dense":
        weight = DenseWeight(values, (8, 4))
    elif make == "mxfp4":
        weight = Mxfp4Weight(*quantize_mxfp4(values), partition_sizes=(8, 4))
    else:
        packed, scale, global_scale = quantize_nvfp4(values)
        weight = Nvfp4Weight(packed, scale, global_scale.reshape(1).repeat(2), (8, 4))
    order = torch.tensor([1, 0, 3, 2, 7, 6, 5, 4, 11, 10, 9, 8])
    moved = rows_reordered(weight, order)
    assert torch.equal(dequantize(moved), dequantize(weight)[order])
    with pytest.raises(ValueError, match="partition"):
        rows_reordered(weight, torch.tensor([8, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11]))
    with pytest.raises(ValueError, match="permutation"):
        rows_reordered(weight, torch.zeros(12, dtype=torch.long))


def _llama4_for_gguf():
    """A tiny Llama 4 with llama.cpp's fixed constants (8192-token chunks, NoPE every 4th layer, the temperature from
    position 8191): 4 layers, dense (MLP 96) and sparse (4 experts of 32, a shared one) alternating."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    from tests.engine.conftest import randomize

    config = Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                              max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=1,
                              interleave_moe_layer_step=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(8)
    hf = AutoModelForCausalLM.from_config(config).eval()
    randomize(hf)
    return hf


class _AsStoredByLlamaCpp:
    """The model's state dict under the names the GGUF test writer maps (feed_forward -> mlp) and its experts as
    transformers' fused [experts, out, in] layout, which llama.cpp's converter splits into ffn_*_exps."""

    def __init__(self, hf):
        self.config = hf.config
        self._tensors = {}
        for name, t in hf.state_dict().items():
            name = llama4_tensor(name)
            self._tensors[name] = t.transpose(1, 2) if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else t

    def state_dict(self):
        return self._tensors


def test_a_llama4_gguf_as_llama_cpp_writes_it(tmp_path):
    """llama.cpp's llama4 file: q / k rows as stored, the shared expert as ffn_*_shexp, experts stacked, the dense
    layers' MLP size as feed_forward_length and the experts' as expert_feed_forward_length: transformers' logits."""
    from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf

    hf = _llama4_for_gguf()
    c = hf.config
    metadata = {"llama4.expert_count": 4, "llama4.expert_used_count": 1, "llama4.expert_feed_forward_length": 32,
                "llama4.interleave_moe_layer_step": 2}
    tensors = gguf_tensors(_AsStoredByLlamaCpp(hf), LLAMA_BLOCK)
    c.intermediate_size = 96  # write_gguf's feed_forward_length: llama.cpp writes intermediate_size_mlp there
    path = write_gguf(tmp_path / "l4.gguf", "llama4", c, tensors, metadata, head_dim=32)
    c.intermediate_size = 32
    ckpt = open_checkpoint(path)
    cls, cfg = resolve_architecture(ckpt.config)
    assert cls.__name__ == "Llama4ForCausalLM" and cfg.moe.layers == {1, 3} and cfg.nope_layers == {3}
    assert cfg.attention_chunk == 8192 and cfg.query_temperature == (8192.0, 0.1) and cfg.qk_norm
    assert cfg.intermediate_size == 96 and cfg.moe.intermediate_size == 32
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
    got = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model.forward_logits(ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    unchunked = dict(metadata, **{"llama4.attention.sliding_window": 0})
    c.intermediate_size = 96
    other = open_checkpoint(write_gguf(tmp_path / "l4-full.gguf", "llama4", c, tensors, unchunked, head_dim=32))
    assert resolve_architecture(other.config)[1].nope_layers == frozenset()  # every layer rotates then
