"""Canonical names: how checkpoint modules map onto radiance's merged linears.

HF checkpoints store q/k/v and gate/up as separate projections; radiance serves them as one merged
linear (`qkv_proj`, `gate_up_proj`) whose partitions keep their own scales. This module is the one
place that knows those spellings, so readers, the writer and `inspect` agree.
"""

from __future__ import annotations

import re

# merged module -> the projections it is made of, in partition order
MERGES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# projection -> (merged module, partition index)
PARTITION_OF: dict[str, tuple[str, int]] = {
    proj: (merged, i) for merged, projs in MERGES.items() for i, proj in enumerate(projs)
}
# a Gated DeltaNet layer's four input projections served as two linears (as vLLM serves them): Qwen3.5 stores the
# parts, Qwen3-Next the merged modules themselves (its rows grouped by key head). Pairs, not one linear of four:
# quantized checkpoints keep the small b / a projections 16-bit while q / k / v / z are quantized, and the parts of
# one linear share one format. Only under a `linear_attn` module.
LINEAR_ATTENTION_MERGES: dict[str, tuple[str, ...]] = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_LINEAR_ATTENTION_PARTITION_OF = {
    proj: (merged, i) for merged, projs in LINEAR_ATTENTION_MERGES.items() for i, proj in enumerate(projs)
}
# projections that are linears but not merged
SINGLE_LINEARS = ("o_proj", "down_proj")
LINEAR_LEAVES = tuple(PARTITION_OF) + SINGLE_LINEARS + tuple(MERGES)
# the projections of a Gated DeltaNet layer, linears only under a `linear_attn` module: Qwen3.5's, Qwen3-Next's
_QWEN3_5_LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LINEAR_ATTENTION_LINEARS = {"Qwen3_5ForCausalLM": _QWEN3_5_LINEAR_ATTENTION,
                            "Qwen3_5MoeForCausalLM": _QWEN3_5_LINEAR_ATTENTION,
                            "Qwen3NextForCausalLM": ("in_proj_qkvz", "in_proj_ba", "out_proj")}
LINEAR_ATTENTION_LEAVES = tuple(dict.fromkeys(leaf for leaves in LINEAR_ATTENTION_LINEARS.values() for leaf in leaves))

# per-module tensors a quantized linear may carry besides `weight`
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2", "weight_scale_inv",
                  "input_scale", "input_global_scale", "weight_zero_point", "input_zero_point", "weight_shape")
TENSOR_SUFFIXES = ("weight", "bias") + QUANT_SUFFIXES
# calibrated attention scales (compressed-tensors' kv_cache_scheme on self_attn, ModelOpt's on k_proj / v_proj):
# one scalar per layer for an fp8 KV cache (and fp8 attention), which radiance's cache does not apply
ATTENTION_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def split_tensor_name(name: str) -> tuple[str, str]:
    """'model.layers.0.mlp.up_proj.weight_scale' -> ('model.layers.0.mlp.up_proj', 'weight_scale')."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def leaf(module: str) -> str:
    return module.rpartition(".")[2]


def is_linear_module(module: str) -> bool:
    """True for the projections radiance serves with a linear kernel (and lm_head)."""
    parent, _, name = module.rpartition(".")
    if name in LINEAR_ATTENTION_LEAVES and parent.endswith(".linear_attn"):
        return True
    return name in LINEAR_LEAVES or module == "lm_head" or module.endswith(".lm_head")


def canonical_linear(module: str) -> tuple[str, int]:
    """Checkpoint projection -> (canonical module, partition index)."""
    parent, _, proj = module.rpartition(".")
    partition_of = _LINEAR_ATTENTION_PARTITION_OF if parent.endswith(".linear_attn") else PARTITION_OF
    if proj in partition_of:
        merged, index = partition_of[proj]
        return f"{parent}.{merged}", index
    return module, 0


def canonical_tensor(name: str) -> tuple[str, int]:
    """(canonical name, partition index) of a transformers tensor name: a projection's weight its linear (merged ones
    by part), a bias its linear's bias, anything else itself."""
    module, _, leafname = name.rpartition(".")
    proj = module.rpartition(".")[2]
    if leafname == "weight" and (proj.endswith("_proj") or proj in LINEAR_ATTENTION_LEAVES):
        return canonical_linear(module)
    if leafname == "bias":
        merged, index = canonical_linear(module)
        return f"{merged}.bias", index
    return name, 0


def partition_modules(canonical: str) -> tuple[str, ...]:
    """Canonical linear -> the checkpoint projections it is made of, in partition order."""
    parent, _, name = canonical.rpartition(".")
    merges = LINEAR_ATTENTION_MERGES if parent.endswith(".linear_attn") else MERGES
    if name in merges:
        return tuple(f"{parent}.{proj}" for proj in merges[name])
    return (canonical,)


def stored_modules(canonical: str, architecture: str | None) -> tuple[str, ...]:
    """The checkpoint modules linear `canonical` is read from in `architecture`'s checkpoints: Qwen3-Next stores
    its linear attention's merged projections whole, every other model the parts (partition_modules)."""
    if leaf(canonical) in LINEAR_ATTENTION_LINEARS.get(architecture, ()):
        return (canonical,)
    return partition_modules(canonical)


_EXPERT_RE = re.compile(r"\.(experts)\.\d+\.|\.(shared_expert)\.")


def layer_kind(module: str) -> str:
    """Class of a linear for reports: 'qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj', 'lm_head'; a sparse
    MLP's 'experts.gate_up_proj', 'shared_expert.down_proj', ..."""
    match = _EXPERT_RE.search(module)
    return f"{match.group(1) or match.group(2)}.{leaf(module)}" if match else leaf(module)


def layer_index(name: str) -> int | None:
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def sort_key(name: str) -> tuple:
    """Embeddings first, then layers in numeric order, then final norm and lm_head."""
    index = layer_index(name)
    if index is not None:
        return (1, index, name)
    if "embed" in name:
        return (0, 0, name)
    return (2, 0, name)
