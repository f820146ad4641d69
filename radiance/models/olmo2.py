"""OLMo 2 (`Olmo2ForCausalLM`: OLMo-2 1B / 7B / 13B / 32B) and OLMo 3 (the same layers, some with sliding windows),
as transformers' Olmo2Model computes them: no norm opens the attention or the MLP; each output is normed
(`post_attention_layernorm`, `post_feedforward_layernorm`) before its residual add, and q and k are normed over their
whole width (every head at once, `q_norm` / `k_norm`) before the rotary. transformers' Olmo2RMSNorm multiplies by the
weight in fp32 before rounding to the model's dtype (Llama's rounds first): every norm here does the same
(RMSNorm.fp32_weight), which only bfloat16 can tell apart."""

from __future__ import annotations

import torch
from torch import nn

from radiance.layers.norm import RMSNorm, weights_in_fp32
from radiance.layers.rotary import RotaryEmbedding
from radiance.models.arch_config import ArchConfig
from radiance.models.llama import LlamaAttention, LlamaBody, LlamaForCausalLM, LlamaMLP
from radiance.models.rope_config import sliding_rope_theta


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__(cfg, rotary, index)
        self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        return self.q_norm(q), self.k_norm(k), None  # whole-width norms here: none per head


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, rotary, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        # the stream arrives as LlamaDecoderLayer hands it on (x: the last output, not yet added to residual); no
        # norm opens this layer to add them in its kernel, so the add is an op of its own
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2Body(LlamaBody):
    layer_class = Olmo2DecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        weights_in_fp32(self)  # the layers' norms, q / k and the final one: all transformers' Olmo2RMSNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    body_class = Olmo2Body


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (`Olmo3ForCausalLM`: OLMo-3 7B / 32B): OLMo 2's layers, three sliding-window layers to one full one
    (config.json's layer_types, window 4096 unless given), the full layers with rope_theta and its scaling (YaRN on
    the long-context models), the sliding ones with the default rope of their own base."""

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        # transformers' Olmo3Config gives the sliding layers 500000 unless rope_parameters names their base, even
        # where an older config.json's top-level rope_theta differs
        return {**cls.arch_overrides, "sliding_rope_theta": sliding_rope_theta(hf_config, 500000.0)}
