"""Tiny synthetic checkpoints written by hand (independently of radiance's writer)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1,
        "torch_dtype": "bfloat16"}
PROJ_SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
               "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
               "mlp.down_proj": (64, 96)}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def dense_state_dict(config: dict = TINY, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random HF-named tensors; each projection gets its own magnitude so partitions differ."""
    gen = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], config["hidden_size"], generator=gen),
          "model.norm.weight": 1 + 0.1 * torch.randn(config["hidden_size"], generator=gen)}
    if not config.get("tie_word_embeddings"):
        sd["lm_head.weight"] = torch.randn(config["vocab_size"], config["hidden_size"], generator=gen)
    for i in range(config["num_hidden_layers"]):
        for j, (proj, shape) in enumerate(PROJ_SHAPES.items()):
            scale = 0.02 * (1 + 3 * j)  # q small, k larger, ...: a max() over partitions would be wrong
            sd[f"model.layers.{i}.{proj}.weight"] = scale * torch.randn(*shape, generator=gen)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(config["hidden_size"], generator=gen)
    return {k: v.to(dtype) for k, v in sd.items()}


def write_dir(path: str, tensors: dict[str, torch.Tensor], config: dict, quantization_config: dict | None = None,
              tokenizer: bool = False) -> str:
    os.makedirs(path, exist_ok=True)
    config = dict(config)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    if tokenizer:
        write_tokenizer(path, config["vocab_size"])
    return path


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer.json plus tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, handle)


def ct_nvfp4_tensors(sd: dict[str, torch.Tensor], modules: list[str]) -> dict[str, torch.Tensor]:
    """Replace `modules` by compressed-tensors NVFP4 tensors (quantized with radiance.formats)."""
    from radiance.formats import quantize_nvfp4

    out = dict(sd)
    for m in modules:
        packed, scale, gs = quantize_nvfp4(out.pop(f"{m}.weight").float())
        out.update({f"{m}.weight_packed": packed, f"{m}.weight_scale": scale, f"{m}.weight_global_scale": gs})
    return out


def linear_modules(config: dict = TINY) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in PROJ_SHAPES]


CT_NVFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": False}, "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head"],
}
