"""A vision-language checkpoint (Mistral Small 3.x's Mistral3ForConditionalGeneration, as transformers saves it)
served as its language model alone: the text_config's model, the language model's tensors under their text-only
names, the vision tower and projector skipped, the quantization_config's exclusions read against the stored names."""

from __future__ import annotations

import json

import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.hf_config import language_model, language_model_tensor
from radiance.checkpoint.inspect import inspect_lines
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture


def tiny_mistral3(tie: bool | None, wrapper: str = "Mistral3"):
    """A random Mistral3ForConditionalGeneration (or, with wrapper "Llava", Pixtral's LlavaForConditionalGeneration)
    with a tiny Mistral language model and Pixtral vision tower."""
    import transformers
    from transformers import MistralConfig, PixtralVisionConfig

    text = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, head_dim=32, sliding_window=None)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=16, head_dim=16)
    config = getattr(transformers, f"{wrapper}Config")(text_config=text, vision_config=vision, image_token_index=10,
                                                       **({} if tie is None else {"tie_word_embeddings": tie}))
    torch.manual_seed(0)
    model = getattr(transformers, f"{wrapper}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model


@pytest.mark.parametrize("wrapper, tie", [("Mistral3", None), ("Mistral3", False), ("Llava", False)])
def test_the_language_model_is_served_as_transformers_computes_it(tmp_path, wrapper, tie):
    """tie None: transformers' default (tied, no lm_head saved); False: an lm_head of its own."""
    hf = tiny_mistral3(tie, wrapper)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # shards and an index.json naming the stored tensors
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.architecture == "MistralForCausalLM" and ckpt.tie_word_embeddings == (tie is None)
    assert any(name.startswith("vision_tower.") for name in ckpt.index.skipped)
    ids = torch.randint(11, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    got = ours.forward_logits(ids)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-4
    lines = "\n".join(inspect_lines(ckpt))
    assert f"MistralForCausalLM (the language model of {wrapper}ForConditionalGeneration)" in lines
    assert "servable   yes" in lines


def test_convert_writes_the_language_model_as_a_text_only_checkpoint(tmp_path):
    tiny_mistral3(False).save_pretrained(tmp_path / "vlm")
    convert_checkpoint(str(tmp_path / "vlm"), str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and "served_from" not in config
    ids = torch.randint(11, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    at_load, converted = (load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization=q),
                                     checkpoint=open_checkpoint(str(p)), progress=False).model.forward_logits(ids)
                          for p, q in ((tmp_path / "vlm", "mxfp4"), (tmp_path / "out", "auto")))
    assert torch.equal(at_load, converted)


def test_exclusions_name_the_stored_modules(tmp_path):
    """A compressed-tensors exclusion list names the modules as the file does (language_model.lm_head, the vision
    tower by regex): no warning that an entry matches nothing, and the excluded head stays dense."""
    tiny_mistral3(False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["language_model.lm_head", "re:vision_tower.*", "re:multi_modal_projector.*"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(str(tmp_path))
    assert not [w for w in ckpt.warnings if "matches no module" in w], ckpt.warnings
    assert ckpt.quant.scheme_for("language_model.lm_head", linear=True).format == "dense"


def test_names_and_refusals():
    assert language_model_tensor("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert language_model_tensor("model.language_model.norm.weight") == "model.norm.weight"
    assert language_model_tensor("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_tensor("model.vision_tower.patch_conv.weight") is None
    assert language_model({"architectures": ["MistralForCausalLM"], "text_config": {}}) is None  # not a wrapper
    # a language model radiance does not serve (Gemma 1 inside PaliGemma): opened as it is, refused by the registry
    paligemma = {"architectures": ["PaliGemmaForConditionalGeneration"], "text_config": {"model_type": "gemma"}}
    assert language_model(paligemma) is None
    with pytest.raises(ConfigError, match="unsupported model architecture PaliGemmaForConditionalGeneration"):
        resolve_architecture(paligemma)
