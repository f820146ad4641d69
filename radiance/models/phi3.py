"""Phi-3 (`Phi3ForCausalLM`: Phi-3-mini / medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the Llama decoder without biases,
its checkpoints storing q/k/v and gate/up already merged (`qkv_proj`, `gate_up_proj`: radiance's own canonical
linears) and, where config.json gives a `sliding_window` (Phi-3-mini-4k: 2047), that window on every layer, as
transformers' Phi3Model attends. LongRoPE (Phi-3.5-mini, the 128k variants; rope_config.longrope, its factor set
chosen by the served context in RotaryEmbedding.serve_context) and a partial rotary (Phi-4-mini: 96 of 128 dims;
ArchConfig.rotary_dim) are the rotary's."""

from radiance.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    arch_overrides = {"qkv_bias": False, "o_bias": False}  # transformers' Phi3 reads no attention_bias
