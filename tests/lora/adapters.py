"""PEFT adapters written by hand (safetensors + adapter_config.json, as PEFT's save_pretrained lays them out) for the
tiny Llama of tests/checkpoint/factory.py, and the merged weights W + scale * B @ A they stand for."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from tests.checkpoint.factory import PROJ_SHAPES, TINY

PEFT_PREFIX = "base_model.model."


def adapter_tensors(rank: int, seed: int, config: dict = TINY, projections=tuple(PROJ_SHAPES)) -> dict[str, torch.Tensor]:
    """Random A [r, K] and non-zero B [N, r] for `projections` of every layer, named as PEFT saves them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for proj in projections:
            out, inp = PROJ_SHAPES[proj]
            module = f"{PEFT_PREFIX}model.layers.{i}.{proj}"
            tensors[f"{module}.lora_A.weight"] = 0.3 * torch.randn(rank, inp, generator=gen)
            tensors[f"{module}.lora_B.weight"] = 0.3 * torch.randn(out, rank, generator=gen)
    return tensors


def write_adapter(path, tensors: dict[str, torch.Tensor], rank: int, alpha: float, **config) -> str:
    os.makedirs(path, exist_ok=True)
    modules = sorted({name.split(".lora_")[0].rpartition(".")[2] for name in tensors if ".lora_" in name})
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny", **config}
    with open(os.path.join(path, "adapter_config.json"), "w") as handle:
        json.dump(body, handle)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def merged_state_dict(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], rank: int, alpha: float,
                      rslora: bool = False) -> dict[str, torch.Tensor]:
    """The base checkpoint with each adapted weight W replaced by W + scale * B @ A (in fp32)."""
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    merged = dict(base)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0].removeprefix(PEFT_PREFIX)
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        merged[f"{module}.weight"] = base[f"{module}.weight"].float() + scale * b.float() @ a.float()
    return merged
