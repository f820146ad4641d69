"""The rotary embedding a config.json describes, as transformers reads it: the base and scaling (old `rope_theta` +
`rope_scaling` or transformers 5's `rope_parameters`), LongRoPE's factor sets, a partial rotary, and the sliding
layers' own base where a model has one (radiance.layers.rotary computes the frequencies)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from radiance.errors import ConfigError
from radiance.models.config_fields import is_positive_number, positive

if TYPE_CHECKING:
    from radiance.models.arch_config import HfDefaults


# rope_type -> the keys its frequencies are computed from (radiance.layers.rotary); longrope's lists are checked
# against the rotary dimension in longrope
ROPE_TYPES = {"default": (), "linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",), "longrope": ()}

# architectures whose transformers model rotates only the leading partial_rotary_factor of each head, and the factor
# their config assumes when config.json gives none
PARTIAL_ROTARY = {"Phi3ForCausalLM": 1.0, "Glm4MoeForCausalLM": 0.5, "Qwen3_5ForCausalLM": 0.25,
                  "Qwen3_5MoeForCausalLM": 0.25, "Qwen3NextForCausalLM": 0.25}

# architectures whose transformers config keeps the rope per layer type (sliding_attention / full_attention) even where
# config.json gives a flat rope_scaling (merged into the full layers'): the scaling is then read as a nested one
PER_LAYER_TYPE_ROPE = {"Gemma3ForCausalLM", "Olmo3ForCausalLM"}


def read_rope(config: dict, defaults: HfDefaults, architecture: str) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling`, checked here so that an unsupported or incomplete scaling is one line before any load.
    A config that gives neither gets the architecture's (gpt-oss: YaRN), as in transformers. Phi-3's older "su"
    and "yarn" spellings come back as rope_type "longrope" (as transformers' Phi3Config reads them)."""
    rope = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    for key, value in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json {key} must be an object, got {value!r}")
    if rope is None and scaling is None:
        scaling = defaults.rope_parameters
    if _scaling_replaces_parameters(config):
        # both (a rope_scaling added to a transformers 5 config): as transformers' convert_rope_params_to_dict,
        # rope_scaling replaces rope_parameters; its own rope_theta first, then the top level's, then the default
        rope = dict(scaling)
    rope = dict(rope or {})
    nested = isinstance(rope.get("full_attention"), dict)
    if nested:  # per layer type (Gemma 3): the full-attention layers' rope
        rope = dict(rope["full_attention"])
        if scaling and not isinstance(scaling.get("full_attention"), dict):
            rope.update(scaling)  # a flat rope_scaling beside it: transformers' Gemma 3 merges it into these layers'
    theta = float(positive(rope if rope.get("rope_theta") is not None else config, "rope_theta",
                            defaults.rope_theta))
    rope.pop("rope_theta", None)
    rope.pop("partial_rotary_factor", None)  # read by _rotary_dim
    scaling = {k: v for k, v in (rope or scaling or {}).items() if k != "partial_rotary_factor"}  # (rope_scaling's)
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if architecture == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    top = config.get("original_max_position_embeddings")
    nested = nested or architecture in PER_LAYER_TYPE_ROPE
    if nested:
        # transformers' _compute_yarn_parameters reads `truncate` from the top of rope_parameters, which holds the
        # layer types here, never a layer type's own: it always truncates (OLMo 3 with truncate false: 13% of the
        # logits apart)
        scaling = {k: v for k, v in scaling.items() if k != "truncate"}
    if kind in ("llama3", "yarn") and top is not None and not nested:
        # transformers' standardize_rope_params gives config.json's top-level value priority over the scaling's
        # own (Phi-3-style configs keep it outside); LongRoPE reads it first in longrope() below
        scaling = {**scaling, "original_max_position_embeddings": top}
    for key in ROPE_TYPES[kind]:
        value = scaling.get(key)
        if not is_positive_number(value):
            raise ConfigError(f"{kind} rope_scaling needs a positive number for {key!r}, got {value!r}")
    # dynamic NTK (transformers) rescales only past max_position_embeddings, which radiance never serves:
    # below it, its frequencies are exactly the default ones
    if kind in ("default", "dynamic"):
        return float(theta), None
    if kind != scaling.get("rope_type", scaling.get("type")):  # a spelling mapped (Phi-3's su / yarn)
        scaling = {**scaling, "rope_type": kind}
    return float(theta), scaling


def sliding_rope_theta(hf_config: dict, default: float, legacy_key: str | None = None) -> float:
    """The rope base of the sliding layers of a model whose layer types rotate apart (Gemma 3, OLMo 3): transformers
    5's rope_parameters["sliding_attention"], else the older config's `legacy_key` (Gemma: rope_local_base_freq),
    else the architecture's default (no scaling either way)."""
    local = (hf_config.get("rope_parameters") or {}).get("sliding_attention")
    theta = (local or {}).get("rope_theta", hf_config.get(legacy_key, default) if legacy_key else default)
    if (local or {}).get("rope_type", "default") != "default":
        raise ConfigError(f"the sliding layers take the default rope, got {local!r}")
    if not is_positive_number(theta):
        raise ConfigError(f"the sliding layers' rope base must be a positive number, got {theta!r}")
    return float(theta)


def _scaling_replaces_parameters(config: dict) -> bool:
    """A config with both a flat rope_parameters and a rope_scaling: transformers 5 reads the rope_scaling in its
    place (a nested, per layer type rope_parameters is not replaced here; transformers' Gemma 3 merges into it)."""
    rope, scaling = config.get("rope_parameters"), config.get("rope_scaling")
    return isinstance(rope, dict) and isinstance(scaling, dict) and bool(scaling) \
        and not isinstance(rope.get("full_attention"), dict)


def rotary_dim_of(config: dict, architecture: str, head_dim: int) -> int | None:
    """The dims of each head that rotate when config.json's partial_rotary_factor is below 1 (transformers 5 keeps
    it in rope_parameters, older configs at the top level or in rope_scaling), None when all do."""
    partial = None
    parameters = None if _scaling_replaces_parameters(config) else config.get("rope_parameters")
    for source in (parameters, config.get("rope_scaling"), config):
        if isinstance(source, dict) and source.get("partial_rotary_factor") is not None:
            partial = source["partial_rotary_factor"]
            break
    if partial is None:
        partial = PARTIAL_ROTARY.get(architecture)
    if partial is None or partial == 1:
        return None
    if architecture not in PARTIAL_ROTARY:
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported for {architecture}: radiance rotates "
                          f"whole heads there (partial rotary: {', '.join(sorted(PARTIAL_ROTARY))})")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial < 1:
        raise ConfigError(f"config.json partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    dims = int(head_dim * partial)  # transformers' rounding
    if dims < 2 or dims % 2:
        raise ConfigError(f"partial_rotary_factor {partial} of head_dim {head_dim} rotates {dims} dims; rotary "
                          f"pairs need an even number of at least 2")
    return dims


def longrope(config: dict, scaling: dict, defaults: HfDefaults, rotary_dim: int, max_positions: int) -> dict:
    """LongRoPE (Phi-3.5-mini, Phi-3-*-128k, Phi-4-mini) as transformers computes it: per-frequency divisors,
    `short_factor` for a context within the pretraining one and `long_factor` past it, and cos / sin scaled by
    sqrt(1 + ln(factor) / ln(original)) with factor = max_position_embeddings / original unless given. The
    pretraining context is config.json's top-level original_max_position_embeddings (Phi-3's default 4096), else
    the scaling's, else max_position_embeddings."""
    original = (config.get("original_max_position_embeddings") or defaults.original_max_position_embeddings
                or scaling.get("original_max_position_embeddings") or max_positions)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"longrope original_max_position_embeddings must be a positive integer, got {original!r}")
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if (not isinstance(values, list) or len(values) != rotary_dim // 2
                or not all(is_positive_number(v) for v in values)):
            raise ConfigError(f"longrope rope_scaling needs {key!r}: a list of {rotary_dim // 2} positive numbers "
                              f"(one per rotary frequency), got {values!r}")
        factors[key] = [float(v) for v in values]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}
