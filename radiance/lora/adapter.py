"""Loads one PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the linears of a served model.

PEFT names a tensor `base_model.model.<module>.lora_A.weight` ([r, K]) or `...lora_B.weight` ([N, r]); the module is
the checkpoint's projection (`model.layers.3.self_attn.q_proj`), mapped here onto radiance's merged linears with
radiance.checkpoint.names (q/k/v -> qkv_proj partitions 0/1/2, gate/up -> gate_up_proj 0/1; a checkpoint that stores
them fused, as Phi-3's qkv_proj, as it is). The scale (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into B.
Everything the serving path does not compute is refused, naming the file and the tensor: DoRA, modules_to_save,
embedding / lm_head LoRA, biases, fan_in_fan_out, ranks above max_lora_rank, MoE expert targets, modules the model
lacks, wrong shapes, non-finite values.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radiance.checkpoint.names import MERGES, canonical_linear
from radiance.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
# <module>.lora_A.weight, or with PEFT's adapter name before .weight (lora_A.default.weight)
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight")
_MOE_MODULE = re.compile(r"\.(experts|shared_experts?|block_sparse_moe)(\.|$)|\.mlp\.gate$|\.router$")


@dataclass(frozen=True)
class LoraTarget:
    """A linear of the served model that takes an adapter: its input width and output partitions (q, k, v of a
    qkv_proj; one for an unmerged linear)."""

    in_features: int
    partitions: tuple[int, ...]


@dataclass
class LoraAdapter:
    """A loaded adapter: per target linear, per partition, (A [r, K], B [N_p, r] with the scale folded in) in fp32
    on the CPU, or None for a partition the adapter leaves alone. `fingerprint`: a digest of its files, which the
    prefix cache keys its blocks by."""

    request: LoRARequest
    rank: int
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
    fingerprint: bytes
    path: str


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names the file (and the tensor where one is at fault)."""


def resolve_adapter_dir(path: str) -> str:
    """The local directory of an adapter: `path` itself, or a Hugging Face Hub id fetched into its cache."""
    if not path:
        raise LoraAdapterError("the adapter has no lora_path to load it from")
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise LoraAdapterError(f"{path}: an adapter is a directory holding {CONFIG_FILE} and {WEIGHTS_FILE}, "
                               "not a file")
    from radiance.checkpoint.hub import hub_model
    hub = hub_model(path)
    if hub is None:
        raise LoraAdapterError(f"{path}: no such adapter directory")
    return _fetch_from_hub(hub, path)


def _fetch_from_hub(hub, path: str) -> str:
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(hub.repo, revision=hub.revision,
                                 allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, PICKLE_WEIGHTS_FILE])
    except Exception as exc:  # noqa: BLE001 - not found, gated, offline: one line naming the id
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoraAdapterError(f"{path}: no such adapter directory, and fetching it from the Hugging Face Hub "
                               f"failed: {first}") from None


def load_adapter(request: LoRARequest, targets: dict[str, LoraTarget], max_rank: int,
                 scale_b: Callable[[str, int | None, torch.Tensor], torch.Tensor] | None = None) -> LoraAdapter:
    """Reads and checks `request`'s adapter against the model's `targets` (canonical linear name -> LoraTarget).
    `scale_b(name, partition, B)`: what the model does to that linear's weight at load (Granite's residual
    multiplier, Llama 4's q / k row order), done to B too (partition None: B of every partition, fused).
    LoraAdapterError (a ValueError) for anything that cannot be served."""
    directory = resolve_adapter_dir(request.lora_path)
    config_file = os.path.join(directory, CONFIG_FILE)
    weights_file = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(config_file):
        raise LoraAdapterError(f"{directory}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has one)")
    if not os.path.isfile(weights_file):
        if os.path.isfile(os.path.join(directory, PICKLE_WEIGHTS_FILE)):
            raise LoraAdapterError(f"{os.path.join(directory, PICKLE_WEIGHTS_FILE)}: pickled weights are not loaded; "
                                   f"save the adapter as {WEIGHTS_FILE} (PEFT's save_pretrained("
                                   "safe_serialization=True), the default)")
        raise LoraAdapterError(f"{directory}: no {WEIGHTS_FILE}")
    with open(config_file, "rb") as handle:
        config_bytes = handle.read()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise LoraAdapterError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_file}: not a JSON object")
    rank, scale = _check_config(config, config_file, max_rank)
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(weights_file, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise LoraAdapterError(f"{weights_file}: cannot be read as safetensors ({exc})") from None
    pairs = _pair_tensors(tensors, weights_file)
    weights: dict[str, list] = {}
    for module, (a_name, b_name) in sorted(pairs.items()):
        canonical, index = _target_of(module, targets, weights_file, a_name)
        target = targets[canonical]
        a, b = tensors[a_name], tensors[b_name]
        out = sum(target.partitions) if index is None else target.partitions[index]
        _check_tensor(a, (rank, target.in_features), weights_file, a_name)
        _check_tensor(b, (out, rank), weights_file, b_name)
        a = a.float()
        b = b.float() * scale
        if scale_b is not None:
            b = scale_b(canonical, index, b)
        parts = weights.setdefault(canonical, [None] * len(target.partitions))
        if index is None:  # stored fused: one A for every partition, B split into them
            if any(part is not None for part in parts):
                raise LoraAdapterError(f"{weights_file}: tensor {a_name}: a second adapter for the same projection")
            for i, b_part in enumerate(b.split(target.partitions)):
                parts[i] = (a, b_part.contiguous())
        elif parts[index] is not None:
            raise LoraAdapterError(f"{weights_file}: tensor {a_name}: a second adapter for the same projection")
        else:
            parts[index] = (a, b)
    if not weights:
        raise LoraAdapterError(f"{weights_file}: no lora_A / lora_B tensors")
    with open(weights_file, "rb") as handle:
        digest = hashlib.sha256(config_bytes)
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return LoraAdapter(request, rank, weights, digest.digest(), directory)


def _check_config(config: dict, file: str, max_rank: int) -> tuple[int, float]:
    """(r, the scale folded into B) of an adapter_config.json, or why it cannot be served."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraAdapterError(f"{file}: peft_type {peft_type!r}: only LoRA adapters are served")
    rank = config.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"{file}: r is {rank}, above max_lora_rank {max_rank} (raise --max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{file}: lora_alpha must be a finite number, got {alpha!r}")
    refusals = (
        ("use_dora", lambda v: bool(v), "DoRA adapters (use_dora) are not supported"),
        ("modules_to_save", lambda v: bool(v), "modules_to_save (fully trained extra modules) are not supported"),
        ("bias", lambda v: v not in (None, "none"), "only bias \"none\" is supported"),
        ("lora_bias", lambda v: bool(v), "LoRA biases (lora_bias) are not supported"),
        ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out (Conv1D-style weights) is not supported"),
        ("rank_pattern", lambda v: bool(v), "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", lambda v: bool(v), "per-module alphas (alpha_pattern) are not supported"),
        ("trainable_token_indices", lambda v: bool(v), "trained token embeddings are not supported"),
    )
    for key, refused, why in refusals:
        if key in config and refused(config[key]):
            raise LoraAdapterError(f"{file}: {why}, got {key} {config[key]!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for name in names:
        if isinstance(name, str) and re.search(r"(^|\.)(embed_tokens|lm_head|wte|embed_in|embed_out)$", name):
            raise LoraAdapterError(f"{file}: target_modules includes {name!r}: LoRA on the embeddings or the "
                                   "lm_head is not supported (attention and MLP linears only)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _pair_tensors(tensors: dict[str, torch.Tensor], file: str) -> dict[str, tuple[str, str]]:
    """module -> (its lora_A tensor's name, its lora_B tensor's name); any other tensor refused by name."""
    found: dict[str, dict[str, str]] = {}
    for name in tensors:
        if "modules_to_save" in name:
            raise LoraAdapterError(f"{file}: tensor {name}: modules_to_save weights are not supported")
        if "lora_magnitude_vector" in name:
            raise LoraAdapterError(f"{file}: tensor {name}: DoRA (a magnitude vector) is not supported")
        if "lora_embedding_" in name or re.search(r"(embed_tokens|lm_head)\.lora_", name):
            raise LoraAdapterError(f"{file}: tensor {name}: LoRA on the embeddings or the lm_head is not supported "
                                   "(attention and MLP linears only)")
        match = _LORA_KEY.fullmatch(name)
        if match is None:
            raise LoraAdapterError(f"{file}: tensor {name}: not a LoRA weight (lora_A / lora_B .weight; a bias "
                                   "or other tensor is not supported)")
        module = match["module"].removeprefix(_PEFT_PREFIX)
        found.setdefault(module, {})[match["which"]] = name
    pairs = {}
    for module, which in found.items():
        if set(which) != {"A", "B"}:
            present = next(iter(which.values()))
            missing = "lora_B" if "A" in which else "lora_A"
            raise LoraAdapterError(f"{file}: tensor {present}: its {missing} is missing")
        pairs[module] = (which["A"], which["B"])
    return pairs


def _target_of(module: str, targets: dict[str, LoraTarget], file: str, tensor: str) -> tuple[str, int | None]:
    """(canonical linear, partition index; None for a linear stored fused) of a PEFT module name."""
    if _MOE_MODULE.search(module):
        raise LoraAdapterError(f"{file}: tensor {tensor}: LoRA on MoE experts or routers is not supported "
                               "(attention and dense MLP linears only)")
    if module.rpartition(".")[0].endswith(".linear_attn"):
        raise LoraAdapterError(f"{file}: tensor {tensor}: LoRA on the linear-attention projections ({module}) is not "
                               "supported (attention and dense MLP linears only)")
    canonical, index = canonical_linear(module)
    if canonical not in targets:
        raise LoraAdapterError(f"{file}: tensor {tensor}: the model has no linear {canonical} that takes an "
                               "adapter (attention and dense MLP linears of its layers do)")
    leaf = module.rpartition(".")[2]
    if leaf in MERGES and len(targets[canonical].partitions) == len(MERGES[leaf]):
        return canonical, None
    return canonical, index


def _check_tensor(tensor: torch.Tensor, shape: tuple[int, int], file: str, name: str) -> None:
    if tuple(tensor.shape) != shape:
        raise LoraAdapterError(f"{file}: tensor {name}: shape {tuple(tensor.shape)}, expected {shape}")
    if not tensor.is_floating_point():
        raise LoraAdapterError(f"{file}: tensor {name}: dtype {tensor.dtype} is not a float type")
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise LoraAdapterError(f"{file}: tensor {name}: {bad} NaN or inf value(s)")
