"""The tensors a Llama / Qwen-style decoder checkpoint must hold, by canonical name (names): embeddings, final norm,
lm_head unless tied; per layer its attention (or Gated DeltaNet linear attention) linears, its norms, its dense or
sparse MLP (router, experts, shared expert). The HF reader checks them at open, so a missing tensor is named before
minutes of weights load."""

from __future__ import annotations

from radiance.checkpoint.names import LINEAR_ATTENTION_LINEARS, canonical_linear, stored_modules
from radiance.errors import ConfigError
from radiance.models.moe_config import MoeConfig, expert_count

# the norms every decoder layer has (OLMo 2 and 3 normalize the attention and MLP outputs only)
_OUTPUT_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_LAYER_NORMS = {None: ("input_layernorm", "post_attention_layernorm"), "Olmo2ForCausalLM": _OUTPUT_NORMS,
                "Olmo3ForCausalLM": _OUTPUT_NORMS}
# a Gated DeltaNet layer's tensors besides its linears (Qwen3.5)
_LINEAR_ATTN_TENSORS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight")


def needed_decoder_tensors(config: dict, architecture: str, tie_word_embeddings: bool) -> list[str]:
    """Canonical names (a linear's module, a plain tensor's name) of what `config` asks for; none where its layers
    or its MoE layout are unknown (the architecture check says why)."""
    layers = config.get("num_hidden_layers")
    if not layers:
        return []
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tie_word_embeddings:
        needed.append("lm_head")
    try:
        moe = MoeConfig.from_hf(config, architecture, layers) if expert_count(config) else None
    except ConfigError:
        return []
    router = "router" if config.get("model_type") == "gpt_oss" else "gate"
    linear = _linear_attention_layers(config, architecture, layers)
    for i in range(layers):
        p = f"model.layers.{i}"
        if i in linear:
            # Qwen3.5's four input projections are served as two linears (names.LINEAR_ATTENTION_MERGES)
            needed += dict.fromkeys(canonical_linear(f"{p}.linear_attn.{name}")[0]
                                    for name in LINEAR_ATTENTION_LINEARS[architecture] + _LINEAR_ATTN_TENSORS)
        else:
            needed += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj"]
        needed += [f"{p}.{norm}.weight" for norm in _LAYER_NORMS.get(architecture, _LAYER_NORMS[None])]
        if moe is not None and i in moe.layers:
            needed.append(f"{p}.mlp.{router}.weight")
            if moe.sigmoid_grouped:
                needed.append(f"{p}.mlp.gate.e_score_correction_bias")
            experts = [f"{p}.mlp.experts.{e}" for e in range(moe.num_experts)]
            if moe.shared_expert_size:
                experts.append(f"{p}.mlp.shared_expert")
                if moe.shared_expert_gated:
                    needed.append(f"{p}.mlp.shared_expert_gate.weight")
            for expert in experts:
                needed += [f"{expert}.gate_up_proj", f"{expert}.down_proj"]
        else:
            needed += [f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"]
    return needed


def first_missing(needed: list[str], have: set[str], architecture: str) -> str | None:
    """The checkpoint tensor to name for the first of `needed` not in `have` (a merged linear by the first part the
    checkpoint would store), or None."""
    for name in needed:
        if name == "lm_head" and ("lm_head.weight" in have or "lm_head" in have):
            continue
        if name not in have:
            return name if name.endswith(".weight") else f"{stored_modules(name, architecture)[0]}.weight"
    return None


def _linear_attention_layers(config: dict, architecture: str, layers: int) -> set[int]:
    """The layers a hybrid model (Qwen3.5, Qwen3-Next) runs as linear attention (none where its layer_types are
    wrong: the model registry names that)."""
    if architecture not in LINEAR_ATTENTION_LINEARS:
        return set()
    from radiance.models.qwen3_5 import layer_types
    try:
        return {i for i, kind in enumerate(layer_types(config, layers)) if kind == "linear_attention"}
    except ConfigError:
        return set()
