"""Llama 4 (`Llama4ForCausalLM`, and the language model of `Llama4ForConditionalGeneration`: Llama-4-Scout-17B-16E,
Llama-4-Maverick-17B-128E), as transformers' Llama4TextModel computes it:

- three layers in four rotate q and k and attend within chunks of `attention_chunk_size` tokens (8192: a query sees
  the keys from its chunk's start up to itself); the fourth (config.json's `no_rope_layers`, 0 = no rotary) attends
  to the whole context without positions (NoPE), its queries scaled by 1 + attn_scale * log(1 + floor((p + 1) /
  floor_scale)) at position p (`attn_temperature_tuning`; 1 below position floor_scale - 1);
- the rotating layers normalize each head of q and k without a weight (`use_qk_norm`; transformers after the
  rotation, radiance before it: the rotation keeps a head's norm, so the two agree but for rounding);
- transformers rotates interleaved pairs (dims 2i, 2i + 1, as complex numbers); radiance rotates halves (i, i + D/2),
  so each head's q and k rows are reordered at load (even dims first, then odd ones): the same attention, any format;
- sparse MLPs (`moe_layers`; Scout: all, Maverick: every second, the others dense of `intermediate_size_mlp`): the
  router's top expert takes the token's input times the sigmoid of its logit, and an ungated shared expert of
  the experts' size runs on every token (radiance.layers.moe.SparseMoeBlock with MoeConfig.scores_scale_input).
"""

from __future__ import annotations

import torch

from radiance.errors import ConfigError
from radiance.formats.weights import rows_reordered
from radiance.layers.norm import RMSNorm
from radiance.layers.rotary import RotaryEmbedding
from radiance.models.arch_config import ArchConfig
from radiance.models.config_fields import given, positive
from radiance.models.llama import LlamaAttention, LlamaBody, LlamaDecoderLayer, LlamaForCausalLM
from radiance.models.smollm3 import rotary_layers


def weightless_rms_norm(size: int, eps: float) -> RMSNorm:
    """An RMSNorm whose weight is a buffer of ones (Llama 4's q / k norm has none): nothing to load."""
    norm = RMSNorm(size, eps)
    del norm.weight
    norm.register_buffer("weight", torch.ones(size), persistent=False)
    return norm


def query_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """float32 factor per position (transformers' attn_temperature_tuning): 1 + attn_scale *
    log(1 + floor((p + 1) / floor_scale))."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__(cfg, rotary, index)
        rotates = self.rotary[0] is not None
        self.q_norm = weightless_rms_norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm and rotates else None
        self.k_norm = weightless_rms_norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm and rotates else None
        self.scaled = cfg.query_temperature is not None and not rotates
        # the step's factors [..., 1], computed once per forward by Llama4Body for every NoPE layer (a shared list)
        self.step_temperature: list[torch.Tensor | None] = [None]

    def scaled_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.scaled:
            return q
        return (q * self.step_temperature[0]).to(q.dtype)  # in float32, as transformers multiplies


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention


class Llama4Body(LlamaBody):
    layer_class = Llama4DecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.temperature = cfg.query_temperature
        self.step_temperature: list[torch.Tensor | None] = [None]
        for layer in self.layers:
            layer.self_attn.step_temperature = self.step_temperature

    def forward(self, input_ids, positions, meta):
        if self.temperature is not None:
            self.step_temperature[0] = query_temperature(positions, *self.temperature).unsqueeze(-1)
        try:
            return super().forward(input_ids, positions, meta)
        finally:
            self.step_temperature[0] = None


class Llama4ForCausalLM(LlamaForCausalLM):
    supports_moe = True
    body_class = Llama4Body

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        # an empty no_rope_layers (Scout's config.json) is transformers' default: every fourth layer without rotary
        rotates = rotary_layers(hf_config if hf_config.get("no_rope_layers") else
                                {k: v for k, v in hf_config.items() if k != "no_rope_layers"})
        nope = frozenset(i for i, rope in enumerate(rotates) if not rope)
        fields = {"nope_layers": nope, "qk_norm": bool(given(hf_config, "use_qk_norm", True))}
        if hf_config.get("intermediate_size_mlp") is not None:  # the dense layers' MLP (Maverick's every second)
            fields["intermediate_size"] = positive(hf_config, "intermediate_size_mlp", None, integer=True)
        chunk = hf_config.get("attention_chunk_size", 8192)  # transformers' default; null: no chunks
        if chunk is not None:
            fields["attention_chunk"] = positive(hf_config, "attention_chunk_size", 8192, integer=True)
            fields["chunked_layers"] = _chunked_layers(hf_config, rotates)
        if given(hf_config, "attn_temperature_tuning", True):
            fields["query_temperature"] = (float(positive(hf_config, "floor_scale", 8192)),
                                           float(given(hf_config, "attn_scale", 0.1)))
        return fields

    def checkpoint_linear(self, name: str, weight):
        """q and k rows per head from interleaved pairs to halves (see the module docstring)."""
        if not name.endswith(".self_attn.qkv_proj"):
            return weight
        cfg = self.config
        head = torch.arange(cfg.head_dim).view(-1, 2).t().reshape(-1)  # 0, 2, 4, ..., 1, 3, 5, ...
        heads = cfg.num_heads + cfg.num_kv_heads
        qk = (torch.arange(heads).unsqueeze(1) * cfg.head_dim + head).reshape(-1)
        order = torch.cat([qk, torch.arange(heads * cfg.head_dim, heads * cfg.head_dim + cfg.kv_size)])
        return rows_reordered(weight, order)


def _chunked_layers(config: dict, rotates: list[int]) -> frozenset[int]:
    """The layers config.json's `layer_types` calls "chunked_attention", without it the rotating ones (as
    transformers' Llama4TextConfig derives them)."""
    types = config.get("layer_types")
    if types is None:
        return frozenset(i for i, rope in enumerate(rotates) if rope)
    if not isinstance(types, list) or len(types) != len(rotates):
        count = len(types) if isinstance(types, list) else repr(types)
        raise ConfigError(f"config.json lists {count} layer_types for {len(rotates)} layers")
    unknown = set(map(str, types)) - {"chunked_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)} for Llama 4 (supported: chunked_attention, "
                          "full_attention)")
    return frozenset(i for i, kind in enumerate(types) if kind == "chunked_attention")
