"""Chooses the model class from config.json `architectures` (or, without it, `model_type`).

`resolve_architecture` is the one check of whether a config is servable: loading calls it, and so do
`radiance inspect` (a warning) and `radiance convert` (a refusal before any work), with the same message.
"""

from __future__ import annotations

from radiance.errors import ConfigError
from radiance.models.arch_config import ArchConfig, named_architectures
from radiance.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from radiance.models.glm4_moe import Glm4MoeForCausalLM
from radiance.models.gpt_oss import GptOssForCausalLM
from radiance.models.granite import GraniteForCausalLM
from radiance.models.llama import LlamaForCausalLM
from radiance.models.llama4 import Llama4ForCausalLM
from radiance.models.mistral import MistralForCausalLM
from radiance.models.mixtral import MixtralForCausalLM
from radiance.models.moe_config import expert_count
from radiance.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from radiance.models.phi3 import Phi3ForCausalLM
from radiance.models.qwen2 import Qwen2ForCausalLM
from radiance.models.qwen2_moe import Qwen2MoeForCausalLM
from radiance.models.qwen3 import Qwen3ForCausalLM
from radiance.models.qwen3_moe import Qwen3MoeForCausalLM
from radiance.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from radiance.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def supported_architectures() -> str:
    return ", ".join(MODEL_CLASSES)


def _unsupported(hf_config: dict) -> ConfigError:
    names, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if names:
        what = f"model architecture {', '.join(map(str, names))}"
    elif model_type:
        what = f"model_type {model_type!r} (config.json lists no architectures)"
    else:
        what = "model: config.json names no architecture (neither 'architectures' nor 'model_type')"
    return ConfigError(f"unsupported {what}; radiance serves {supported_architectures()}")


def resolve_architecture(hf_config: dict) -> tuple[type[LlamaForCausalLM], ArchConfig]:
    """The model class and its ArchConfig; a ConfigError of one line for anything radiance cannot serve."""
    for name in named_architectures(hf_config):
        if name in MODEL_CLASSES:
            cls = MODEL_CLASSES[name]
            experts = expert_count(hf_config)
            if experts and not cls.supports_moe:  # before ArchConfig asks for the expert sizes
                moe_classes = ", ".join(n for n, c in MODEL_CLASSES.items() if c.supports_moe)
                raise ConfigError(f"config.json gives {name} {experts} experts; radiance serves "
                                  f"mixture-of-experts MLPs for {moe_classes}")
            return cls, ArchConfig.from_hf(hf_config, name, **cls.overrides(hf_config))
    raise _unsupported(hf_config)


def build_model(hf_config: dict) -> LlamaForCausalLM:
    cls, cfg = resolve_architecture(hf_config)
    return cls(cfg)


# canonical tensor name endings -> the parameter that holds them in our module tree
_PARAMETER_ENDINGS = (
    ("self_attn.qkv_proj.bias", "self_attn.qkv_bias"),
    ("self_attn.o_proj.bias", "self_attn.o_bias"),  # gpt-oss
    ("gate_up_proj.bias", "gate_up_bias"),  # gpt-oss experts
    ("down_proj.bias", "down_bias"),
    ("mlp.router.weight", "mlp.gate.weight"),  # gpt-oss's router is Qwen's gate
    ("mlp.router.bias", "mlp.gate.bias"),
)


def parameter_name(tensor: str) -> str:
    """Canonical tensor name -> parameter name in our module tree (the loader and `servable` share it)."""
    for ending, target in _PARAMETER_ENDINGS:
        if tensor.endswith(ending):
            return tensor[: -len(ending)] + target
    return tensor
