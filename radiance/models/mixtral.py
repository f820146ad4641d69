"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, 8x22B): the Mistral decoder whose every MLP is sparse (the experts of
`intermediate_size`, the router's softmax top-k renormalized: radiance.layers.moe.SparseMoeBlock), its checkpoints
naming the block `block_sparse_moe` and the experts' linears w1 / w3 / w2 (read as gate / up / down by
hf_config.mixtral_tensor); a `sliding_window` applies to every layer, as for Mistral."""

from radiance.models.mistral import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    supports_moe = True
