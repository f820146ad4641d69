"""Synthetic models: the exact public configs of real models with random weights, built directly on
the target device (no download), so GPU benchmarks run at true shapes.

`SyntheticCheckpoint` quacks like `radiance.checkpoint.open_checkpoint(...)`: `.config`,
`.names()`, `.iter_weights()` with the canonical names of docs/ARCHITECTURE.md, and no tokenizer.
`weight_format` picks what the linears arrive as: 16-bit (`dense`, the loader may quantize them),
or already `mxfp4` / `nvfp4` (as a quantized checkpoint would deliver them).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import torch
from tqdm import tqdm

from radiance.checkpoint.base import Checkpoint, EntryInfo
from radiance.checkpoint.quant_config import QuantSpec
from radiance.errors import ConfigError
from radiance.models.moe_config import MoeConfig

logger = logging.getLogger(__name__)

PREFIX = "synthetic:"

# config.json of each model as published on the Hugging Face hub (checked against the model cards;
# only the fields a model needs, verbatim values).
SYNTHETIC_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": 128000, "eos_token_id": 128001,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
        "initializer_range": 0.02,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "initializer_range": 0.02,
    },
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "initializer_range": 0.02,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_experts": 128, "num_experts_per_tok": 8,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "initializer_range": 0.02,
    },
    "gemma-3-12b": {  # the text_config of google/gemma-3-12b-it (Gemma3ForConditionalGeneration), as a text model
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attention_bias": False, "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1,
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 262208, "initializer_range": 0.02,
    },
    "gemma-3-27b": {  # the text_config of google/gemma-3-27b-it
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attention_bias": False, "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1,
        "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
        "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 262208, "initializer_range": 0.02,
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": True, "hidden_act": "silu", "eos_token_id": 200002, "pad_token_id": 199999,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 201088,
        "initializer_range": 0.02,
    },
    "glm-4.5-air": {  # zai-org/GLM-4.5-Air's config.json (its multi-token-prediction layer is not built)
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "attention_bias": True, "hidden_act": "silu", "eos_token_id": [151329, 151336, 151338],
        "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "use_qk_norm": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151552,
        "initializer_range": 0.02,
    },
    "qwen3.5-9b": {  # transformers' Qwen3_5TextConfig defaults ("the Qwen3.5-9B style configuration", its docstring)
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "attention_bias": False, "hidden_act": "silu", "eos_token_id": 248044,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 248320,
        "initializer_range": 0.02,
    },
    "qwen3-next-80b-a3b": {  # transformers' Qwen3NextConfig defaults: Qwen3-Next-80B-A3B's sizes (MTP not built)
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "attention_bias": False, "hidden_act": "silu", "eos_token_id": 151645,
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "initializer_range": 0.02,
    },
    "llama-4-scout-17b-16e": {  # the text_config of meta-llama/Llama-4-Scout-17B-16E-Instruct, as a text model
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
        "no_rope_layers": [], "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192,
        "attn_scale": 0.1, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 202048,
        "initializer_range": 0.02,
    },
}

WEIGHT_FORMATS = ("dense", "mxfp4", "nvfp4")
Entry = tuple[str, tuple[int, ...], tuple[int, ...] | None]  # (name, shape, partition sizes or None: a plain tensor)


def is_synthetic(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)


def synthetic_config(name: str, overrides: dict | None = None) -> dict:
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if key not in SYNTHETIC_CONFIGS:
        raise ConfigError(f"unknown synthetic model {name!r}; expected one of "
                          + ", ".join(PREFIX + k for k in SYNTHETIC_CONFIGS))
    config = copy.deepcopy(SYNTHETIC_CONFIGS[key])
    config.update(overrides or {})
    return config


class SyntheticCheckpoint(Checkpoint):
    """Random weights with a real model's shapes, generated one tensor at a time on `device`: a checkpoint without
    files, tokenizer or chat template (token-id prompts only)."""

    def __init__(self, name: str, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
                 weight_format: str = "dense", rule: str = "mse", seed: int = 0, overrides: dict | None = None):
        if weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"synthetic weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        super().__init__(path=name if name.startswith(PREFIX) else PREFIX + name, kind="synthetic",
                         config=synthetic_config(name, overrides), quant=QuantSpec())
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.weight_format = weight_format
        self.rule = rule
        self.seed = seed

    def tokenizer(self):
        return None

    @property
    def has_tokenizer(self) -> bool:
        return False

    @property
    def chat_template(self) -> str | None:
        return None

    @property
    def eos_token_ids(self) -> list[int]:
        return []

    def describe(self) -> list[EntryInfo]:
        dtype = str(self.dtype).removeprefix("torch.")
        return [EntryInfo(name, is_linear=partitions is not None,
                          format=self.weight_format if partitions is not None else dtype, shape=shape,
                          partition_sizes=partitions or ())
                for name, shape, partitions in self._entries()]

    # ------------------------------------------------------------------ shapes

    def _dims(self) -> dict:
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return {"hidden": c["hidden_size"], "inter": c["intermediate_size"], "q": c["num_attention_heads"] * head_dim,
                "kv": c["num_key_value_heads"] * head_dim, "head_dim": head_dim}

    def _layer_entries(self, i: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...] | None]]:
        """(name, shape, partition_sizes or None for a plain tensor) of layer i, in load order."""
        d, pre = self._dims(), f"model.layers.{i}."
        hybrid = self.config.get("model_type") in ("qwen3_5_text", "qwen3_next")
        if hybrid and self.config["layer_types"][i] == "linear_attention":
            entries = self._linear_attention_entries(pre, d["hidden"])
        else:
            q = 2 * d["q"] if hybrid else d["q"]  # Qwen3.5's / Qwen3-Next's q_proj gives each head a gate too
            entries = self._attention_entries(pre, d, q)
        architecture = (self.config.get("architectures") or ["synthetic"])[0]
        moe = MoeConfig.from_hf(self.config, architecture, self.config["num_hidden_layers"])
        if moe is not None and i in moe.layers:
            entries += self._sparse_mlp_entries(pre, d["hidden"], moe)
        else:
            inter = self.config.get("intermediate_size_mlp", d["inter"])
            entries += self._mlp_entries(pre + "mlp.", d["hidden"], inter)
        return entries

    def _attention_entries(self, pre: str, d: dict, q: int) -> list[Entry]:
        """A layer's norms and attention (q: the q rows of qkv_proj)."""
        entries = [(pre + "input_layernorm.weight", (d["hidden"],), None),
                   (pre + "self_attn.qkv_proj", (q + 2 * d["kv"], d["hidden"]), (q, d["kv"], d["kv"]))]
        if self.config.get("attention_bias") or self.config.get("model_type") == "qwen2":
            entries.append((pre + "self_attn.qkv_proj.bias", (d["q"] + 2 * d["kv"],), None))
        gemma = self.config.get("model_type") == "gemma3_text"
        glm_norms = self.config.get("model_type") == "glm4_moe" and self.config.get("use_qk_norm")
        if self.config.get("model_type") in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_next") or gemma or glm_norms:
            entries += [(pre + "self_attn.q_norm.weight", (d["head_dim"],), None),
                        (pre + "self_attn.k_norm.weight", (d["head_dim"],), None)]
        entries += [(pre + "self_attn.o_proj", (d["hidden"], d["q"]), (d["hidden"],)),
                    (pre + "post_attention_layernorm.weight", (d["hidden"],), None)]
        if gemma:  # the norm before the MLP and the one of its output
            entries += [(pre + "pre_feedforward_layernorm.weight", (d["hidden"],), None),
                        (pre + "post_feedforward_layernorm.weight", (d["hidden"],), None)]
        if self.config.get("model_type") == "gpt_oss":
            entries += [(pre + "self_attn.o_proj.bias", (d["hidden"],), None),
                        (pre + "self_attn.sinks", (self.config["num_attention_heads"],), None)]
        return entries

    def _sparse_mlp_entries(self, pre: str, hidden: int, moe) -> list[Entry]:
        """A sparse MLP: its router, experts and shared expert."""
        router = pre + ("mlp.router" if self.config.get("model_type") == "gpt_oss" else "mlp.gate")
        entries = [(router + ".weight", (moe.num_experts, hidden), None)]
        if moe.router_bias:
            entries.append((router + ".bias", (moe.num_experts,), None))
        if moe.sigmoid_grouped:
            entries.append((router + ".e_score_correction_bias", (moe.num_experts,), None))
        for e in range(moe.num_experts):
            expert = self._mlp_entries(f"{pre}mlp.experts.{e}.", hidden, moe.intermediate_size)
            if moe.expert_bias:
                expert += [(name + ".bias", shape[:1], None) for name, shape, _ in expert]
            entries += expert
        if moe.shared_expert_size:
            entries += self._mlp_entries(pre + "mlp.shared_expert.", hidden, moe.shared_expert_size)
            if moe.shared_expert_gated:
                entries.append((pre + "mlp.shared_expert_gate.weight", (1, hidden), None))
        return entries

    def _linear_attention_entries(self, pre: str, hidden: int) -> list[Entry]:
        """A Gated DeltaNet layer (Qwen3.5; Qwen3-Next's two projections grouped by key head): its norm,
        projections, conv, decay parameters and gated norm."""
        from radiance.models.qwen3_5 import linear_attention_config

        la, pre = linear_attention_config(self.config), pre + "linear_attn."
        heads = la.num_value_heads
        qkvz, ba = la.conv_channels + la.value_size, 2 * heads
        # as served: Qwen3.5's in_proj_qkv | in_proj_z and in_proj_b | in_proj_a merged (names.LINEAR_ATTENTION_MERGES)
        qkvz_parts, ba_parts = (((qkvz,), (ba,)) if self.config.get("model_type") == "qwen3_next"
                                else ((la.conv_channels, la.value_size), (heads, heads)))
        projections = [(pre + "in_proj_qkvz", (qkvz, hidden), qkvz_parts), (pre + "in_proj_ba", (ba, hidden), ba_parts)]
        return [(pre.removesuffix("linear_attn.") + "input_layernorm.weight", (hidden,), None), *projections,
                (pre + "conv1d.weight", (la.conv_channels, 1, la.conv_kernel), None),
                (pre + "dt_bias", (heads,), None), (pre + "A_log", (heads,), None),
                (pre + "norm.weight", (la.value_head_dim,), None),
                (pre + "out_proj", (hidden, la.value_size), (hidden,)),
                (pre.removesuffix("linear_attn.") + "post_attention_layernorm.weight", (hidden,), None)]

    @staticmethod
    def _mlp_entries(pre: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        return [(pre + "gate_up_proj", (2 * inter, hidden), (inter, inter)),
                (pre + "down_proj", (hidden, inter), (hidden,))]

    def _entries(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...] | None]]:
        c, d = self.config, self._dims()
        out = [("model.embed_tokens.weight", (c["vocab_size"], d["hidden"]), None)]
        for i in range(c["num_hidden_layers"]):
            out += self._layer_entries(i)
        out.append(("model.norm.weight", (d["hidden"],), None))
        if not c.get("tie_word_embeddings", False):
            out.append(("lm_head.weight", (c["vocab_size"], d["hidden"]), None))
        return out

    def num_parameters(self) -> int:
        total = 0
        for _, shape, _ in self._entries():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    # ------------------------------------------------------------------ weights

    def _linear(self, values: torch.Tensor, partitions: tuple[int, ...]):
        from radiance.formats import DenseWeight, Mxfp4Weight, Nvfp4Weight, quantize_mxfp4, quantize_nvfp4

        if self.weight_format == "mxfp4":
            packed, scale = quantize_mxfp4(values, rule=self.rule)
            return Mxfp4Weight(packed, scale, partitions)
        if self.weight_format == "nvfp4":
            packed, scale, global_scale = quantize_nvfp4(values, partitions)
            return Nvfp4Weight(packed, scale, global_scale, partitions)
        return DenseWeight(values, partitions)

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, object]]:
        """Yield (canonical name, Weight or tensor) one at a time, each made on the device.
        Norm weights are ones (as initialized), everything else N(0, initializer_range)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed)
        std = float(self.config.get("initializer_range", 0.02))
        entries = self._entries()
        for name, shape, partitions in tqdm(entries, desc=f"building {self.path}", unit="tensor",
                                            disable=not progress, leave=False):
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=self.dtype, device=self.device)
                continue
            values = torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, std, generator=gen)
            yield name, (self._linear(values, partitions) if partitions is not None else values)
