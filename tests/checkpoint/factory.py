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


# ---------------------------------------------------------------------- more formats, for the checkpoint fuzz


def ct_mxfp4_tensors(sd: dict[str, torch.Tensor], modules: list[str], main: str = "weight_packed"):
    """`modules` as MXFP4 codes + e8m0 scales; `main` "weight" is Quark's OCP MX layout."""
    from radiance.formats import quantize_mxfp4

    out = dict(sd)
    for m in modules:
        out[f"{m}.{main}"], out[f"{m}.weight_scale"] = quantize_mxfp4(out.pop(f"{m}.weight").float())[:2]
    return out


def fp8_tensors(sd: dict[str, torch.Tensor], modules: list[str], per_tensor: bool = False):
    """`modules` as e4m3 weights with fp32 scales per output channel [N, 1] (or one per tensor [1])."""
    out = dict(sd)
    for m in modules:
        w = out.pop(f"{m}.weight").float()
        scale = w.abs().amax().reshape(1) if per_tensor else w.abs().amax(dim=1, keepdim=True)
        scale = scale / 448
        out[f"{m}.weight"], out[f"{m}.weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
    return out


def fp8_block_tensors(sd: dict[str, torch.Tensor], modules: list[str], block: tuple[int, int] = (32, 64)):
    """`modules` as transformers' block FP8: e4m3 `weight` and fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]."""
    out, (bn, bk) = dict(sd), block
    for m in modules:
        w = out.pop(f"{m}.weight").float()
        rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
        scales = torch.empty(rows, cols)
        codes = torch.empty_like(w)
        for i in range(rows):
            for j in range(cols):
                tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                scales[i, j] = tile.abs().max() / 448
                codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = tile / scales[i, j]
        out[f"{m}.weight"], out[f"{m}.weight_scale_inv"] = codes.to(torch.float8_e4m3fn), scales
    return out


def modelopt_nvfp4_tensors(sd: dict[str, torch.Tensor], modules: list[str]):
    """ModelOpt's NVFP4: codes under `weight`, e4m3 `weight_scale`, fp32 `weight_scale_2` (1 / the global scale)."""
    out = ct_nvfp4_tensors(sd, modules)
    for m in modules:
        out[f"{m}.weight"] = out.pop(f"{m}.weight_packed")
        out[f"{m}.weight_scale_2"] = (1.0 / out.pop(f"{m}.weight_global_scale")).reshape(())
    return out


CT_MXFP4_CONFIG = dict(CT_NVFP4_CONFIG, format="mxfp4-pack-quantized", config_groups={"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                       "strategy": "group", "dynamic": False},
    "input_activations": None, "output_activations": None}})
QUARK_MXFP4_CONFIG = {"quant_method": "quark", "exclude": ["lm_head"], "global_quant_config": {"weight": {
    "dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}}}


def ct_fp8_config(strategy: str = "channel") -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}}}}


HF_FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 64],
                 "modules_to_not_convert": ["lm_head"]}
MODELOPT_NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                         "exclude_modules": ["lm_head"]}


def write_sharded(path: str, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> str:
    """The tensors over `shards` files, with the model.safetensors.index.json that maps each one."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    return path


GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 32, "layer_types": ["full_attention"], "eos_token_id": 2,
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def gpt_oss_tensors(config: dict = GPT_OSS, seed: int = 0) -> dict[str, torch.Tensor]:
    """gpt-oss as OpenAI publishes it: 16-bit attention and router, each layer's experts stacked as MXFP4
    `*_blocks` [E, N, K/32, 16] + `*_scales` [E, N, K/32] with 16-bit `*_bias` [E, N]."""
    from radiance.formats import quantize_mxfp4

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, experts, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_local_experts",
                                                         "vocab_size"))
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    rand = lambda *shape: 0.05 * torch.randn(*shape, generator=gen)  # noqa: E731
    sd = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
          "model.norm.weight": 1 + rand(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, (n, k) in {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                             "o_proj": (hidden, q)}.items():
            sd[f"{p}.self_attn.{proj}.weight"], sd[f"{p}.self_attn.{proj}.bias"] = rand(n, k), rand(n)
        sd[f"{p}.self_attn.sinks"] = rand(config["num_attention_heads"])
        sd[f"{p}.mlp.router.weight"], sd[f"{p}.mlp.router.bias"] = rand(experts, hidden), rand(experts)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"{p}.{norm}.weight"] = 1 + rand(hidden)
        for proj, (n, k) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
            blocks, scales = zip(*(quantize_mxfp4(rand(n, k))[:2] for _ in range(experts)))
            sd[f"{p}.mlp.experts.{proj}_blocks"] = torch.stack(blocks).reshape(experts, n, k // 32, 16)
            sd[f"{p}.mlp.experts.{proj}_scales"] = torch.stack(scales)
            sd[f"{p}.mlp.experts.{proj}_bias"] = rand(experts, n)
    return {k: v if v.dtype == torch.uint8 else v.to(torch.bfloat16) for k, v in sd.items()}
