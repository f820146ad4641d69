"""SmolLM3 (`SmolLM3ForCausalLM`: SmolLM3-3B): the Llama decoder in which every fourth layer (config.json's
`no_rope_layers`, 0 = no rotary; without it every `no_rope_layer_interval`-th) attends without positions (NoPE), and
where `use_sliding_window` is on, those layers (or the ones `layer_types` names) slide, as transformers reads it."""

from radiance.errors import ConfigError
from radiance.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        return {"nope_layers": frozenset(i for i, rope in enumerate(rotary_layers(hf_config)) if not rope)}


def rotary_layers(config: dict) -> list[int]:
    """1 for each layer that rotates q and k, 0 for a NoPE layer (transformers' SmolLM3Config.no_rope_layers)."""
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        return []  # ArchConfig names the missing size
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"config.json field 'no_rope_layer_interval' must be a positive integer, "
                              f"got {interval!r}")
        return [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"config.json field 'no_rope_layers' must list 0 or 1 for each of the {layers} layers, "
                          f"got {flags!r}")
    return [int(f) for f in flags[:layers]]
