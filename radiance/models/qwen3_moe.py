"""Qwen3-MoE: the Qwen3 decoder whose MLPs are sparse (radiance.layers.moe.SparseMoeBlock), except the
layers config.json lists in `mlp_only_layers` or skips with `decoder_sparse_step`."""

from radiance.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_moe = True
