"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on q and k before the rotary embedding."""

from radiance.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    arch_overrides = {"qk_norm": True}
