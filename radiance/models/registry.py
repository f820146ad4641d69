"""Chooses the model class from config.json `architectures`."""

from __future__ import annotations

from radiance.errors import ConfigError
from radiance.models.arch_config import ArchConfig
from radiance.models.gpt_oss import GptOssForCausalLM
from radiance.models.llama import LlamaForCausalLM
from radiance.models.qwen2 import Qwen2ForCausalLM
from radiance.models.qwen2_moe import Qwen2MoeForCausalLM
from radiance.models.qwen3 import Qwen3ForCausalLM
from radiance.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_architecture(hf_config: dict) -> tuple[type[LlamaForCausalLM], ArchConfig]:
    names = hf_config.get("architectures") or []
    if not names and hf_config.get("model_type") == "llama":
        names = ["LlamaForCausalLM"]
    for name in names:
        if name in MODEL_CLASSES:
            cls = MODEL_CLASSES[name]
            cfg = ArchConfig.from_hf(hf_config, name, **cls.arch_overrides)
            if cfg.moe is not None and not cls.supports_moe:
                raise ConfigError(f"config.json gives {name} {cfg.moe.num_experts} experts; radiance serves "
                                  f"mixture-of-experts MLPs for {', '.join(n for n, c in MODEL_CLASSES.items() if c.supports_moe)}")
            return cls, cfg
    raise ConfigError(f"unsupported model architecture {names or '(none given)'}; "
                      f"supported: {', '.join(MODEL_CLASSES)}")


def build_model(hf_config: dict) -> LlamaForCausalLM:
    cls, cfg = resolve_architecture(hf_config)
    return cls(cfg)
