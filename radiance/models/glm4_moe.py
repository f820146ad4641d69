"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`: GLM-4.5-Air, GLM-4.5, GLM-4.6): the Llama decoder with q / k / v biases
(attention_bias; o_proj has none), optional per-head q / k RMSNorm (use_qk_norm), rotary on the leading half of each
head (partial_rotary_factor, 0.5 unless given), and after `first_k_dense_replace` dense layers sparse MLPs with
DeepSeek-V3's grouped sigmoid router and an ungated shared expert (MoeConfig.sigmoid_grouped). The checkpoints' extra
multi-token-prediction layer (model.layers.<num_hidden_layers>) is not read, as transformers skips it."""

from radiance.models.config_fields import given
from radiance.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    supports_moe = True

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        return {"o_bias": False, "qk_norm": bool(given(hf_config, "use_qk_norm", False))}
