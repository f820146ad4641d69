"""Qwen2: the Llama decoder with a bias on the merged qkv projection."""

from radiance.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    arch_overrides = {"qkv_bias": True, "o_bias": False}  # whatever attention_bias says: o_proj has none
