"""Whether radiance can serve a checkpoint, decided from config.json and the tensor headers alone.

Loading a model checks the same things one at a time, minutes in for a large model; `radiance inspect`
reports them as warnings and `radiance convert` refuses before writing anything, so a converted
checkpoint always loads. The verdicts come from the loader's own rules (the model registry, the module
tree built on the meta device), so the three commands cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radiance.checkpoint.base import Checkpoint
from radiance.errors import CheckpointError, ConfigError


def architecture_problem(ckpt: Checkpoint) -> str | None:
    """Why the model registry refuses this checkpoint's config (the message loading would fail with), or None."""
    try:
        ckpt.resolve_architecture()
    except ConfigError as exc:
        return str(exc)
    return None


@dataclass
class Fit:
    """How a checkpoint's entries fit the module tree of the model its config.json asks for."""

    architecture: str
    unused: list[str]  # checkpoint entries the model has no place for (loading stops at the first)
    missing: list[str]  # model parameters and linears no entry fills (loading fails after reading everything)


def fit(ckpt: Checkpoint) -> Fit:
    """Match the entries against the model as the loader does. Call it only for a config that
    `architecture_problem` accepts."""
    from radiance.layers.linear import UnloadedLinear
    from radiance.models.registry import build_model, parameter_name  # the loader's own name mapping

    with torch.device("meta"):
        model = build_model(ckpt.config)
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    linears = {n for n, m in model.named_modules() if isinstance(m, UnloadedLinear)}
    unused, filled = [], set()
    for entry in ckpt.describe():
        target = entry.name if entry.is_linear else parameter_name(entry.name)
        if entry.name == "lm_head":  # a quantized head replaces the 16-bit weight
            target = "lm_head.weight"
        if target in params or target in linears:
            filled.add(target)
        elif not (target == "lm_head.weight" and (tied or entry.is_linear)):
            unused.append(entry.name)
    missing = [n for n in list(params) + sorted(linears) if n not in filled]
    return Fit(model.config.architecture, unused, missing)


def servability_problem(ckpt: Checkpoint) -> str | None:
    """The one line loading this checkpoint for serving would fail with (as `check_servable` says it), or None."""
    try:
        check_servable(ckpt)
    except (ConfigError, CheckpointError) as exc:
        return str(exc)
    return None


def check_servable(ckpt: Checkpoint) -> None:
    """Raise what loading would: ConfigError for the architecture, CheckpointError naming the tensor at fault."""
    problem = architecture_problem(ckpt)
    if problem is not None:
        raise ConfigError(problem)
    found = fit(ckpt)
    if found.unused:
        count = "1 tensor" if len(found.unused) == 1 else f"{len(found.unused)} tensors, the first"
        tensor = ckpt.stored_name(found.unused[0])
        raise CheckpointError(f"{count} not used by the {found.architecture} model", file=ckpt.file_of(tensor),
                              tensor=tensor)
    if found.missing:
        raise CheckpointError(f"the checkpoint lacks {len(found.missing)} weight(s) the {found.architecture} "
                              f"model needs, e.g. {found.missing[0]}", file=ckpt.path)

