"""Converting linears between formats, with the error of every conversion reported.

`convert_linear` is the single-weight step; `convert_weights` applies it to a checkpoint stream
(keeping lm_head and --ignore'd linears 16-bit) and feeds a RequantReport. The engine's loader can call
either for quantization at load.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Iterator

import torch

from radiance.checkpoint.base import is_weight
from radiance.checkpoint.names import leaf, partition_modules
from radiance.checkpoint.report import RequantReport
from radiance.errors import CheckpointError, ConfigError
from radiance.formats import (DenseWeight, Fp8Weight, Nvfp4Weight, dequantize, quantize_fp8_per_channel,
                              quantize_nvfp4, to_mxfp4)
from radiance.formats._checks import MX_SCALE_MAX_BYTE, nonfinite_count

logger = logging.getLogger(__name__)

TARGETS = ("mxfp4", "nvfp4", "fp8", "dense")


_REL_RMS_CHUNK = 1 << 22  # elements squared in float64 at a time: 32 MiB per copy, whatever the tensor


def rel_rms(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """||approx - ref|| / ||ref|| (0 for an all-zero reference), squared in float64 chunk by chunk: fp32 squares
    of weights near 1e20 overflowed (a nan report), near 1e-25 underflowed (0)."""
    approx, ref = approx.reshape(-1), ref.reshape(-1)
    err = norm = 0.0
    for start in range(0, ref.numel(), _REL_RMS_CHUNK):
        a, r = approx[start:start + _REL_RMS_CHUNK].double(), ref[start:start + _REL_RMS_CHUNK].double()
        err += float((a - r).square().sum())
        norm += float(r.square().sum())
    return (err / norm) ** 0.5 if norm > 0 else 0.0


def convert_linear(weight, target: str, rule: str = "mse", chunk_rows: int | None = None,
                   dense_dtype: torch.dtype = torch.bfloat16):
    """Weight -> (Weight in `target` with the same partitions, relRMS vs the dequantized source).

    A weight already in the target format is returned unchanged (relRMS 0): never requantize a
    quantized weight into its own format.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target format {target!r}; expected one of {TARGETS}")
    if weight.format == target and not (target == "dense" and weight.tensor.dtype != dense_dtype) \
            and not getattr(weight, "block_k", 0):  # block-scaled FP8 is written per channel: requantized
        return weight, 0.0
    if target == "mxfp4":
        return to_mxfp4(weight, rule=rule, chunk_rows=chunk_rows)
    source = dequantize(weight)
    sizes = weight.partition_sizes
    if target == "nvfp4":
        packed, scale, global_scale = quantize_nvfp4(source, sizes, power_of_two=weight.format == "mxfp4")
        new = Nvfp4Weight(packed, scale, global_scale, sizes)
    elif target == "fp8":
        w8, scale = quantize_fp8_per_channel(source, power_of_two=weight.format == "mxfp4")  # MXFP4: exact
        new = Fp8Weight(w8, scale, sizes)
    else:
        new = DenseWeight(source.to(dense_dtype), sizes)
    return new, rel_rms(dequantize(new), source)


def culprit_tensor(name: str, weight) -> str:
    """The checkpoint tensor behind a conversion that failed on a NaN or inf: the weight of the partition
    (q/k/v, gate/up) holding the first one; the merged name when there is none to find."""
    try:
        bad = ~torch.isfinite(dequantize(weight))
    except ValueError:  # the codec refused the stored scales themselves: an MXFP4 scale past float32
        if weight.format != "mxfp4":
            return name
        bad = weight.scale > MX_SCALE_MAX_BYTE
    rows = bad.any(dim=1).nonzero()
    modules = partition_modules(name)
    if not len(rows) or len(modules) != len(weight.partition_sizes):
        return name
    row = int(rows[0])
    for module, size in zip(modules, weight.partition_sizes):
        if row < size:
            return f"{module}.weight"
        row -= size
    return name


class IgnoreSelection:
    """Which linears `ignore` regexes (re.search, like the CLI's --ignore) keep 16-bit, remembering which patterns
    matched a linear at all (`unmatched`).

    A pattern may name radiance's linear (`model.layers.0.self_attn.qkv_proj`) or, as vLLM's and compressed-tensors'
    ignore lists do, the checkpoint modules a merged linear is made of (`q_proj`, `k_proj`, `v_proj`). The parts of a
    merged linear are served as one: it is selected when every part is (a pattern that matches the merged name and
    none of its parts, `qkv_proj`, selects them all); selecting some parts only is a ConfigError naming both sets,
    where vLLM raises "different quantization schemes" (matching `v_proj` against the merged name alone kept all of
    q/k/v 16-bit, and `q_proj` matched nothing, both without a word).
    """

    def __init__(self, patterns: Iterable[str]):
        self.patterns = tuple(patterns)
        self._matched: set[str] = set()

    def __call__(self, name: str, partitions: int | None = None) -> bool:
        """Whether linear `name` (canonical) is selected; `partitions`: how many parts its weight holds (a merged
        linear the source stored whole, Phi-3's qkv_proj, has one: its own name)."""
        if not self.patterns:
            return False
        parts = partition_modules(name) if partitions != 1 else (name,)
        by_part: dict[str, list[str]] = {part: [] for part in parts}
        for pattern in self.patterns:
            hits = [part for part in parts if re.search(pattern, part)]
            if not hits and re.search(pattern, name):
                hits = list(parts)  # names the merged linear itself
            for part in hits:
                by_part[part].append(pattern)
            if hits:
                self._matched.add(pattern)
        selected = [part for part, found in by_part.items() if found]
        if selected and len(selected) < len(parts):
            patterns = sorted({p for part in selected for p in by_part[part]})
            rest = [part for part in parts if part not in selected]
            raise ConfigError(
                f"ignore pattern(s) {', '.join(map(repr, patterns))} select {', '.join(map(leaf, selected))} but not "
                f"{', '.join(map(leaf, rest))} of {name}: they are fused into one linear, kept 16-bit or quantized "
                f"together (as in vLLM); select all of its parts (e.g. {leaf(name)!r}) or none, got ignore "
                f"{list(self.patterns)}")
        return bool(selected)

    def unmatched(self) -> list[str]:
        """The patterns that matched no linear asked about so far."""
        return [p for p in self.patterns if p not in self._matched]

    def warn_unmatched(self, where: str) -> None:
        for pattern in self.unmatched():
            logger.warning("ignore pattern %r matches no linear of %s (it is searched in radiance's linear names, "
                           "e.g. model.layers.0.self_attn.qkv_proj, and in the checkpoint's module names, "
                           "e.g. model.layers.0.self_attn.q_proj)", pattern, where)


def selects(patterns: Iterable[str], name: str, partitions: int | None = None) -> bool:
    """True when the `ignore` regexes select linear `name` (IgnoreSelection, whose ConfigError a partly selected
    merged linear raises)."""
    return IgnoreSelection(patterns)(name, partitions)


def convert_weights(items: Iterator[tuple[str, object]], target: str, rule: str = "mse",
                    ignore: tuple[str, ...] = (), quantize_lm_head: bool = False,
                    report: RequantReport | None = None, chunk_rows: int | None = None,
                    dense_dtype: torch.dtype = torch.bfloat16, file_of=None
                    ) -> Iterator[tuple[str, object]]:
    """Stream (name, Weight|tensor) -> the same with linears converted to `target`.

    lm_head (unless `quantize_lm_head`) and linears an `ignore` regex selects (IgnoreSelection: radiance's name or
    the checkpoint modules it is made of; a pattern matching none is warned about) become 16-bit `DenseWeight`s;
    plain tensors pass through. Each conversion is added to `report`. A weight that cannot be converted (a NaN in
    it) is a CheckpointError naming the tensor and `file_of(tensor)` (Checkpoint.file_of: its shard).
    """
    def refuse_non_finite(values: torch.Tensor, culprit: str) -> None:
        """Norms, embeddings and linears kept 16-bit are written as they are: a NaN there made a checkpoint that
        loading refuses (naming the new file, not the source)."""
        count = nonfinite_count(values)
        if count:
            raise CheckpointError(f"{count} NaN or inf value(s): refusing to write them",
                                  file=file_of(culprit) if file_of is not None else None, tensor=culprit)

    selection = IgnoreSelection(ignore)
    for name, obj in items:
        if name == "lm_head.weight" and quantize_lm_head:
            obj, name = DenseWeight(obj), "lm_head"
        if not is_weight(obj):
            if isinstance(obj, torch.Tensor):
                refuse_non_finite(obj, name)
                if name == "lm_head.weight":  # a 16-bit head, kept so: `--ignore lm_head` matched it all the same
                    selection("lm_head", 1)
            yield name, obj
            continue
        source_format = obj.format  # what the report names as the source (int4, not the values it starts from)
        if obj.format == "int4":  # GGUF's 4-bit codes have no compressed-tensors form: start from their values
            obj = DenseWeight(dequantize(obj), obj.partition_sizes)
        keep_dense = selection(name, len(obj.partition_sizes)) or (name == "lm_head" and not quantize_lm_head)
        goal = "dense" if keep_dense else target
        if goal == "dense" and obj.format == "dense":
            refuse_non_finite(dequantize(obj), culprit_tensor(name, obj))
            if report is not None:
                report.keep(name, "dense")
            yield name, obj  # the writer casts it to the 16-bit dtype
            continue
        try:
            new, err = convert_linear(obj, goal, rule, chunk_rows, dense_dtype)
        except CheckpointError:
            raise
        except ValueError as exc:  # the codecs know no names: add them
            culprit = culprit_tensor(name, obj)
            raise CheckpointError(f"cannot convert {name} to {goal}: {exc}",
                                  file=file_of(culprit) if file_of is not None else None, tensor=culprit) from None
        if report is not None:
            if new is obj:
                report.keep(name, source_format)
            else:
                report.add(name, source_format, err, goal)
        yield name, new
    selection.warn_unmatched("this checkpoint")
