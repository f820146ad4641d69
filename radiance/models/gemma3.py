"""Gemma 3 (`Gemma3ForCausalLM`: gemma-3-1b, and the language model of the 4B / 12B / 27B
`Gemma3ForConditionalGeneration`), as transformers' Gemma3TextModel computes it (and Gemma 2, Gemma2ForCausalLM
below, as its Gemma2Model does):

- four RMSNorms per layer, each scaling by 1 + weight (folded into an fp32 weight at load, applied before the one
  rounding to the model's dtype, as transformers' Gemma3RMSNorm does: `fp32_weight`): the input norm, a norm of the
  attention output before its residual add (`post_attention_layernorm`), the norm before the MLP
  (`pre_feedforward_layernorm`) and one of the MLP output (`post_feedforward_layernorm`);
- q and k normed per head (as Qwen3), attention scaled by query_pre_attn_scalar ** -0.5;
- five sliding-window layers to one full one (config.json's layer_types, or its sliding_window_pattern), the
  sliding ones rotating with their own base (rope_local_base_freq, 10000) and no scaling, the full ones with
  rope_theta and rope_scaling (linear x8 on the 4B and up);
- a GeGLU MLP (gelu_pytorch_tanh), embeddings times sqrt(hidden_size) in the model's dtype, a tied head.

Attention biases and Gemma 2's final-logit soft-capping are served when a Gemma 3 config sets them, as transformers'
Gemma 3 serves them (its attention never applies attn_logit_softcapping: neither does radiance's). Refused at load:
bidirectional attention (EmbeddingGemma).
"""

from __future__ import annotations

import torch
from torch import nn

from radiance.errors import ConfigError
from radiance.models.config_fields import is_positive_number
from radiance.kernels.glu import GELU_TANH, GELU_TANH_NAMES
from radiance.layers.linear import takes_fp8
from radiance.layers.norm import RMSNorm, scale_by_one_plus_weight, weights_in_fp32
from radiance.layers.rotary import RotaryEmbedding
from radiance.models.arch_config import ArchConfig
from radiance.models.llama import LlamaAttention, LlamaBody, LlamaForCausalLM, LlamaMLP, input_norm
from radiance.models.rope_config import sliding_rope_theta


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="attn_norm")
        self.self_attn = LlamaAttention(cfg, rotary, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="mlp_norm")
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        # the residual stream as LlamaDecoderLayer keeps it (x: what the next add brings in); the extra norms of the
        # attention and MLP outputs come before those adds
        x, residual = input_norm(self.input_layernorm, x, residual, fp8=takes_fp8(self.self_attn.qkv_proj))
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual, fp8=takes_fp8(self.mlp.gate_up_proj))
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Body(LlamaBody):
    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        weights_in_fp32(self)  # every norm, q / k and the final one too: transformers' Gemma3RMSNorm


class Gemma3ForCausalLM(LlamaForCausalLM):
    body_class = Gemma3Body
    # attention_bias is read as for Llama (q, k, v and o), as transformers' Gemma attention reads it
    arch_overrides = {"qk_norm": True, "mlp_activation": GELU_TANH}
    default_softcaps = (None, None)  # transformers' Gemma3TextConfig: no soft-capping unless config.json sets it

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        # transformers' Gemma3Attention keeps attn_logit_softcapping but never applies it; the final cap it applies
        caps = {**softcaps(hf_config, cls.default_softcaps), "attn_softcap": None}
        return {**gemma_overrides(cls, hf_config), **caps,
                "sliding_rope_theta": sliding_rope_theta(hf_config, 10000.0, legacy_key="rope_local_base_freq")}

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden, fp32)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def finish_loading(self) -> None:
        scale_by_one_plus_weight(self)  # Gemma's RMSNorm scales by 1 + weight


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (gemma-2-2b / 9b / 27b): Gemma 3's layers without the q / k norms, sliding and full layers alternating
    (both with rope_theta's rope), and soft-capped logits: each attention logit x becomes c * tanh(x / c) with c =
    attn_logit_softcapping (50), each output logit likewise with final_logit_softcapping (30)."""

    arch_overrides = {**Gemma3ForCausalLM.arch_overrides, "qk_norm": False}
    default_softcaps = (50.0, 30.0)  # transformers' Gemma2Config

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        return {**gemma_overrides(cls, hf_config), **softcaps(hf_config, cls.default_softcaps)}


def softcaps(hf_config: dict, defaults: tuple[float | None, float | None]) -> dict:
    """attn_softcap / final_softcap from config.json's attn_logit_softcapping / final_logit_softcapping (absent: the
    architecture's defaults; null: none)."""
    caps = {}
    for (key, field), default in zip((("attn_logit_softcapping", "attn_softcap"),
                                      ("final_logit_softcapping", "final_softcap")), defaults):
        value = hf_config.get(key, default)
        if value is not None and not is_positive_number(value):
            raise ConfigError(f"config.json field {key!r} must be a positive number or null, got {value!r}")
        caps[field] = None if value is None else float(value)
    return caps


def gemma_overrides(cls, hf_config: dict) -> dict:
    """What Gemma 2 and 3 read alike: the activation (GeGLU only), no bidirectional attention, the embeddings times
    sqrt(hidden_size), the attention scaled by query_pre_attn_scalar ** -0.5."""
    if hf_config.get("use_bidirectional_attention"):
        raise ConfigError("config.json asks for bidirectional attention (an embedding model): not supported")
    activation = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in GELU_TANH_NAMES:
        raise ConfigError(f"hidden_activation {activation!r} is not supported for Gemma (only gelu_pytorch_tanh)")
    hidden = hf_config.get("hidden_size") or 0
    scalar = hf_config.get("query_pre_attn_scalar", 256)
    if not is_positive_number(scalar):
        raise ConfigError(f"config.json field 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    return {**cls.arch_overrides, "embed_scale": hidden ** 0.5, "attention_scale": float(scalar) ** -0.5}
