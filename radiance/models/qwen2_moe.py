"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (qkv bias) with sparse MLPs that also run a
gated shared expert (radiance.layers.moe.SparseMoeBlock)."""

from radiance.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    supports_moe = True
