"""gpt-oss (OpenAI): the Llama decoder with biased attention (q, k, v and o), a learned sink logit per head,
sliding-window attention on alternate layers (config.json `layer_types`), YaRN rotary, and sparse MLPs in
every layer: 32 / 128 biased experts with a clamped SwiGLU, picked by a biased router (top 4, softmax over
the picked logits). The checkpoints store the experts as MXFP4 already (radiance.checkpoint.stacked_experts)."""

from radiance.models.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    arch_overrides = {"attention_sinks": True}  # the q/k/v/o biases: attention_bias (default true)
    supports_moe = True
