"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (qkv bias) with sparse MLPs that also run a
gated shared expert (radiance.layers.moe.SparseMoeBlock)."""

from radiance.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    supports_moe = True

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        # transformers' Qwen2-MoE reads the q/k/v bias from `qkv_bias` (default true); o_proj has none
        qkv_bias = hf_config.get("qkv_bias")
        return {"qkv_bias": True if qkv_bias is None else bool(qkv_bias), "o_bias": False}
