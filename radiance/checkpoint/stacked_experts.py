"""Experts stored stacked, one tensor per layer for all E experts (gpt-oss, Llama 4), as radiance's per-expert linears.

gpt-oss checkpoints keep each sparse MLP's experts under `<layer>.mlp.experts` as
  - MXFP4 (the published checkpoints): `gate_up_proj_blocks` uint8 [E, 2I, K/32, 16] (32 e2m1 codes per
    16 bytes, low nibble first: radiance's packing), `gate_up_proj_scales` uint8 e8m0 [E, 2I, K/32], and the
    same for `down_proj` ([E, H, I/32, 16], [E, H, I/32]);
  - or 16-bit (transformers' own save): `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (input-major);
  - biases `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H].
The rows of gate_up alternate gate and up (gate = rows 0, 2, 4, ..., up = rows 1, 3, ...); radiance's merged
linear is [gate | up], so they are regrouped here. MXFP4 rows are independent (scales run along K), so the
regrouping is lossless. Each expert becomes `<layer>.mlp.experts.<e>.gate_up_proj` / `.down_proj` (a Weight)
and `....gate_up_proj.bias` / `....down_proj.bias` (tensors), the names a per-expert checkpoint would use.

Llama 4's 16-bit checkpoints stack theirs the same way (`feed_forward.experts`, read as `mlp.experts`), input-major,
without biases, and with gate_up as [gate | up] halves already (transformers' Llama4TextExperts chunks it in two).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from radiance.checkpoint.layout import check_scales
from radiance.checkpoint.safetensors_io import SafetensorsIndex
from radiance.errors import CheckpointError
from radiance.models.moe_config import expert_count
from radiance.formats import DenseWeight, Mxfp4Weight
from radiance.formats.mxfp4 import MX_BLOCK

_STACKED_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")
PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class StackedExperts:
    """One layer's stacked expert tensors: `prefix` is '<layer>.mlp.experts'."""

    prefix: str
    format: str  # "mxfp4" | "dense"
    num_experts: int
    interleaved: bool = True  # gate_up's rows alternate gate and up (gpt-oss); else [gate | up] (Llama 4)
    biased: bool = True  # both projections have stacked biases (gpt-oss)

    def tensor_names(self) -> list[str]:
        suffixes = ("_blocks", "_scales") if self.format == "mxfp4" else ("",)
        suffixes += ("_bias",) if self.biased else ()
        return [f"{self.prefix}.{p}{s}" for p in PROJECTIONS for s in suffixes]

    def linear_names(self) -> list[str]:
        return [f"{self.prefix}.{e}.{p}" for e in range(self.num_experts) for p in PROJECTIONS]


def find_stacked_experts(index: SafetensorsIndex, config: dict) -> dict[str, StackedExperts]:
    """The stacked expert groups of a checkpoint, each checked complete and of the shapes config.json gives."""
    found: dict[str, set[str]] = {}
    for name in index.meta:
        match = _STACKED_RE.match(name)
        if match:
            found.setdefault(match.group(1), set()).add(match.group(2) + (match.group(3) or ""))
    groups = {}
    for prefix, leaves in found.items():
        fmt = "mxfp4" if any(leaf.endswith("_blocks") for leaf in leaves) else "dense"
        experts = expert_count(config) or 0
        llama4 = config.get("model_type") in ("llama4", "llama4_text")
        group = StackedExperts(prefix, fmt, int(experts), interleaved=not llama4, biased=not llama4)
        for name in group.tensor_names():
            if name not in index.meta:
                raise CheckpointError("tensor missing from the checkpoint", file=index.model_dir, tensor=name)
        _check_shapes(group, index, config)
        groups[prefix] = group
    return groups


def _expected_shapes(group: StackedExperts, config: dict) -> dict[str, tuple[int, ...]]:
    e, hidden, inter = group.num_experts, config.get("hidden_size"), config.get("intermediate_size")
    p = group.prefix
    shapes = {f"{p}.gate_up_proj_bias": (e, 2 * inter), f"{p}.down_proj_bias": (e, hidden)} if group.biased else {}
    if group.format == "mxfp4":
        shapes.update({
            f"{p}.gate_up_proj_blocks": (e, 2 * inter, hidden // MX_BLOCK, MX_BLOCK // 2),
            f"{p}.gate_up_proj_scales": (e, 2 * inter, hidden // MX_BLOCK),
            f"{p}.down_proj_blocks": (e, hidden, inter // MX_BLOCK, MX_BLOCK // 2),
            f"{p}.down_proj_scales": (e, hidden, inter // MX_BLOCK),
        })
    else:
        shapes.update({f"{p}.gate_up_proj": (e, hidden, 2 * inter), f"{p}.down_proj": (e, inter, hidden)})
    return shapes


def _check_shapes(group: StackedExperts, index: SafetensorsIndex, config: dict) -> None:
    for key in ("hidden_size", "intermediate_size"):
        if not config.get(key):
            raise CheckpointError(f"config.json lacks {key!r}, needed for the stacked experts", file=index.model_dir,
                                  tensor=f"{group.prefix}.gate_up_proj")
    if not group.num_experts:
        raise CheckpointError("config.json gives no expert count (num_local_experts) for the stacked experts",
                              file=index.model_dir, tensor=f"{group.prefix}.gate_up_proj")
    for name, expected in _expected_shapes(group, config).items():
        meta = index.meta[name]
        if tuple(meta.shape) != expected:
            raise CheckpointError(f"wrong shape {list(meta.shape)}, expected {list(expected)}", file=meta.file,
                                  tensor=name)
        packed = name.endswith(("_blocks", "_scales"))
        if packed != (meta.dtype == torch.uint8) or (not packed and not meta.dtype.is_floating_point):
            raise CheckpointError(f"wrong dtype {meta.dtype}, expected {'uint8' if packed else 'a float'}",
                                  file=meta.file, tensor=name)


def gate_up_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) that alternate gate and up -> [gate rows | up rows]."""
    return torch.cat([t[0::2], t[1::2]])


def read_stacked_experts(group: StackedExperts, index: SafetensorsIndex) -> Iterator[tuple[str, object]]:
    """(canonical name, Weight or bias tensor) for every expert of the group."""
    p = group.prefix
    biases = {proj: index.get(f"{p}.{proj}_bias") for proj in PROJECTIONS} if group.biased else None
    regroup = gate_up_rows if group.interleaved else (lambda t: t)
    if group.format == "mxfp4":
        stored = {proj: (index.get(f"{p}.{proj}_blocks"), index.get(f"{p}.{proj}_scales")) for proj in PROJECTIONS}
        for proj in PROJECTIONS:
            name = f"{p}.{proj}_scales"
            check_scales(stored[proj][1], "mxfp4 e8m0 scales", index.meta[name].file, name)
    else:
        stored = {proj: (index.get(f"{p}.{proj}"), None) for proj in PROJECTIONS}
    for e in range(group.num_experts):
        for proj in PROJECTIONS:
            weight, scales = stored[proj]
            if scales is not None:
                rows = weight.shape[1]
                packed, scale = weight[e].reshape(rows, -1), scales[e]
                if proj == "gate_up_proj":
                    packed, scale = regroup(packed), regroup(scale)
                item = Mxfp4Weight(packed.contiguous(), scale.contiguous(), _partitions(proj, rows))
            else:
                w = weight[e].t()  # stored input-major
                item = DenseWeight((regroup(w) if proj == "gate_up_proj" else w).contiguous(),
                                   _partitions(proj, w.shape[0]))
            yield f"{p}.{e}.{proj}", item
            if biases is not None:
                bias = biases[proj][e]
                yield f"{p}.{e}.{proj}.bias", regroup(bias) if proj == "gate_up_proj" else bias.clone()


def _partitions(proj: str, rows: int) -> tuple[int, ...]:
    return (rows // 2, rows // 2) if proj == "gate_up_proj" else (rows,)
