"""Granite (`GraniteForCausalLM`: IBM Granite 3.x dense models), as transformers' GraniteModel computes it: the Llama
decoder with four scalars. `embedding_multiplier` scales the embeddings, `attention_multiplier` is the attention's
scale (in place of head_dim ** -0.5), `residual_multiplier` scales what each attention and MLP adds to the residual
stream, and the logits are divided by `logits_scaling`.

The residual multiplier is folded into o_proj and down_proj at load (their weights' scales, and o_proj's bias), so
the fused residual-add norms and the GEMMs' split-K partials serve Granite unchanged; only an MXFP4 checkpoint with a
multiplier that is not a power of two cannot take it (its block scales are powers of two) and is refused."""

from __future__ import annotations

import torch

from radiance.errors import ConfigError
from radiance.models.config_fields import is_positive_number
from radiance.formats import scaled
from radiance.models.llama import LlamaForCausalLM

_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        values = {}
        for key in _MULTIPLIERS:
            value = hf_config.get(key, 1.0)  # transformers' GraniteConfig defaults
            if not is_positive_number(value):
                raise ConfigError(f"config.json field {key!r} must be a positive number, got {value!r}")
            values[key] = float(value)
        return {**cls.arch_overrides, "embed_scale": values["embedding_multiplier"], "embed_scale_rounded": False,
                "attention_scale": values["attention_multiplier"],
                "residual_multiplier": values["residual_multiplier"], "logits_scaling": values["logits_scaling"]}

    def checkpoint_linear(self, name: str, weight):
        if self.config.residual_multiplier != 1.0 and name.endswith((".o_proj", ".down_proj")):
            try:
                return scaled(weight, self.config.residual_multiplier)
            except ValueError as exc:
                raise ValueError(f"Granite's residual_multiplier {self.config.residual_multiplier} cannot be folded "
                                 f"into this linear: {exc}") from None
        return weight

    def finish_loading(self) -> None:
        """o_proj's bias (attention_bias) is added before the residual multiplier too."""
        if self.config.residual_multiplier == 1.0:
            return
        with torch.no_grad():
            for layer in self.model.layers:
                if layer.self_attn.o_bias is not None:
                    layer.self_attn.o_bias.mul_(self.config.residual_multiplier)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden, fp32)
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling
