"""Mistral (`MistralForCausalLM`: Mistral-7B, Mistral-Nemo, Mistral-Small): the Llama decoder without biases and,
where config.json gives a `sliding_window`, that window on every layer (arch_config._sliding_window), as
transformers' MistralModel attends."""

from radiance.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    arch_overrides = {"qkv_bias": False, "o_bias": False}  # transformers' Mistral reads no attention_bias
