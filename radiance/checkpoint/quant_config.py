"""quantization_config parsing: which format each linear is stored in, and which modules are ignored.

Five producers are understood:
- compressed-tensors (`quant_method: compressed-tensors`): `config_groups` of schemes with `targets`
  ("Linear", exact module names or "re:" regexes), an `ignore` list, a storage `format`
  (nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized, naive-quantized, dense, mixed-precision);
- AMD Quark (`quant_method: quark`): `global_quant_config`, `layer_quant_config` (glob patterns),
  `layer_type_quant_config` and an `exclude` list; OCP MX fp4 stores `weight` + e8m0 `weight_scale`;
- NVIDIA ModelOpt (`quant_method: modelopt` in config.json, or `hf_quant_config.json`): one `quant_algo`
  for every linear (NVFP4: `weight` packed + e4m3 `weight_scale` + fp32 `weight_scale_2`; FP8) and an
  `exclude_modules` list of globs;
- OpenAI's MXFP4 (`quant_method: mxfp4`, gpt-oss): only the stacked experts are MXFP4 (`*_blocks` /
  `*_scales`, read by stacked_experts.py), every linear is 16-bit; `modules_to_not_convert` lists them;
- transformers' FP8 (`quant_method: fp8`, Qwen3-*-FP8, DeepSeek-style): every linear fp8 e4m3 `weight` with one
  `weight_scale_inv` per `weight_block_size` block (128 x 128), `modules_to_not_convert` left 16-bit.

Exclusion lists must name MODULES. An entry naming a tensor (`mtp.fc.weight`) silently matches nothing
in other loaders and the load dies later on a shape mismatch; here it is detected, a warning says how to
fix the config, and it is matched as the author meant (`mtp.fc`).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field

from radiance.checkpoint.names import TENSOR_SUFFIXES, is_linear_module, split_tensor_name
from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

METHODS = ("none", "compressed-tensors", "quark", "modelopt", "mxfp4", "fp8")
# storage format strings of compressed-tensors that hold each of our formats
_CT_STORAGE = {
    "nvfp4": ("nvfp4-pack-quantized",),
    "mxfp4": ("mxfp4-pack-quantized",),
    "fp8": ("float-quantized", "naive-quantized"),
}
# the weight schemes of the compressed-tensors presets radiance reads (a config group `{"FP8_DYNAMIC": ["Linear"]}`),
# as compressed-tensors defines them: parsed like a written-out group, so the fp8 ones say how their scales go
_NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
_MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
_CT_PRESET_WEIGHTS = {
    "NVFP4": _NVFP4, "NVFP4A16": _NVFP4, "MXFP4": _MXFP4, "MXFP4A16": _MXFP4,
    "FP8": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    "FP8_DYNAMIC": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "FP8_BLOCK": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
}
_TENSOR_LEAF_RE = re.compile(r"\\?\.(" + "|".join(TENSOR_SUFFIXES) + r")(\$?)$")


@dataclass(frozen=True)
class QuantScheme:
    """How the linears a scheme targets are stored."""

    format: str  # "mxfp4" | "nvfp4" | "fp8" | "dense"
    layout: str  # "compressed-tensors" | "quark" | "modelopt" | "hf-fp8": decides the tensor names
    targets: tuple[str, ...] = ()
    group: str = ""
    # fp8: how the config says its scales go ("rows": per channel or per tensor; "block": per block of `block`
    # (rows, K) where the config gives it; "": the scale's shape says), so a transposed per-channel scale is not
    # read as blocks
    scales: str = ""
    block: tuple[int, int] | None = None


DENSE = QuantScheme("dense", "none")


def _matches(pattern: str, module: str) -> bool:
    """Exact module name, "re:" regex (anchored at the start, like compressed-tensors) or a glob."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return pattern == module


def module_form(entry: str) -> str | None:
    """The module an exclusion entry meant when it names a tensor ('mtp.fc.weight' -> 'mtp.fc'), else None."""
    if entry.startswith("re:"):
        match = _TENSOR_LEAF_RE.search(entry[3:])
        if match:
            return "re:" + entry[3:][: match.start()] + match.group(2)
        return None
    module, leaf = split_tensor_name(entry)
    if module and leaf in TENSOR_SUFFIXES:
        return module
    return None


@dataclass
class QuantSpec:
    """The parsed quantization_config of a checkpoint."""

    method: str = "none"
    storage: str = ""  # top-level storage format string as written
    schemes: tuple[QuantScheme, ...] = ()
    type_schemes: dict[str, QuantScheme] = field(default_factory=dict)  # quark layer_type_quant_config
    global_scheme: QuantScheme | None = None  # quark global_quant_config
    ignore: tuple[str, ...] = ()  # module patterns, tensor-named entries already turned into modules
    ignore_as_written: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)
    source: str = ""  # file the config came from, for messages

    # ------------------------------------------------------------------ queries

    def is_ignored(self, module: str) -> bool:
        return any(_matches(p, module) for p in self.ignore)

    def scheme_for(self, module: str, linear: bool | None = None) -> QuantScheme:
        """The scheme a checkpoint module (one projection, not a merged linear) is stored with.

        `linear`: whether the module is an nn.Linear (class targets such as "Linear" match it); by
        default guessed from its name (projections and lm_head).
        """
        if self.method == "none" or self.is_ignored(module):
            return DENSE
        exact = [s for s in self.schemes if module in s.targets]
        if exact:
            return exact[0]
        pattern = [s for s in self.schemes
                   if any(_matches(t, module) for t in s.targets if t not in ("Linear", "nn.Linear"))]
        if pattern:
            return pattern[0]
        if is_linear_module(module) if linear is None else linear:
            by_class = [s for s in self.schemes if {"Linear", "nn.Linear"} & set(s.targets)]
            if by_class:
                return by_class[0]
            for key in ("Linear", "nn.Linear", "torch.nn.Linear"):
                if key in self.type_schemes:
                    return self.type_schemes[key]
            if self.global_scheme is not None:
                return self.global_scheme
        return DENSE

    def formats(self) -> list[str]:
        found = {s.format for s in self.schemes} | {s.format for s in self.type_schemes.values()}
        if self.global_scheme is not None:
            found.add(self.global_scheme.format)
        return sorted(found - {"dense"})

    def describe(self) -> str:
        if self.method == "none":
            return "none (16-bit)"
        text = f"{self.method} {self.storage or '/'.join(self.formats())}".strip()
        if self.ignore_as_written:
            text += f" (ignore: {', '.join(self.ignore_as_written)})"
        return text

    def check_modules(self, modules: list[str]) -> None:
        """Warn about exclusion entries that match none of the checkpoint's modules."""
        for entry in self.ignore:
            if not any(_matches(entry, m) for m in modules):
                self._warn(f"quantization_config exclusion entry {entry!r} matches no module of this checkpoint")

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)


# ---------------------------------------------------------------------- parsing


def parse_quantization_config(qc: dict | None, source: str = "config.json") -> QuantSpec:
    """Parse a quantization_config dict (None -> unquantized)."""
    if not qc:
        return QuantSpec(source=source)
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        spec = _parse_compressed_tensors(qc, source)
    elif method == "quark":
        spec = _parse_quark(qc, source)
    elif method == "modelopt":
        spec = _parse_modelopt(qc, source)
    elif method == "mxfp4":  # the experts' format is in their tensor names; no linear is quantized
        spec = QuantSpec(method="mxfp4", storage="mxfp4 (experts)", source=source)
    elif method == "fp8":
        spec = _parse_hf_fp8(qc, source)
    else:
        what = (f"unsupported quantization_config.quant_method {qc['quant_method']!r}" if qc.get("quant_method")
                else "quantization_config has no quant_method")
        raise CheckpointError(f"{what}; radiance reads {', '.join(METHODS[1:])} checkpoints (or unquantized ones)",
                              file=source)
    exclusions = {"compressed-tensors": "ignore", "quark": "exclude", "modelopt": "exclude_modules",
                  "mxfp4": "modules_to_not_convert", "fp8": "modules_to_not_convert"}[method]
    # transformers' fp8 quantizer never converts the head, whether modules_to_not_convert says so or not
    implicit = ["lm_head"] if method == "fp8" and "lm_head" not in (qc.get(exclusions) or []) else []
    _resolve_ignore(spec, [*(qc.get(exclusions) or []), *implicit])
    _check_regexes([*spec.ignore_as_written, *(t for scheme in spec.schemes for t in scheme.targets)], source)
    return spec


def _check_regexes(patterns: list, source: str) -> None:
    """Every "re:" pattern compiles (it raised re.error, a traceback, when the first module was matched)."""
    for pattern in patterns:
        if isinstance(pattern, str) and pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise CheckpointError(f"quantization_config pattern {pattern!r} is not a valid regular expression: "
                                      f"{exc}", file=source) from None


def _resolve_ignore(spec: QuantSpec, entries: list) -> None:
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise CheckpointError("quantization_config ignore/exclude must be a list of module names", file=spec.source)
    resolved = []
    for entry in entries:
        meant = module_form(entry)
        if meant is not None:
            spec._warn(f"quantization_config exclusion entry {entry!r} names a tensor, not a module, so other "
                       f"loaders match nothing with it; radiance treats it as {meant!r}. Fix the config: "
                       f"write {meant!r} instead of {entry!r}")
            resolved.append(meant)
        else:
            resolved.append(entry)
    spec.ignore = tuple(resolved)
    spec.ignore_as_written = tuple(entries)


def _ct_format(weights: dict | None, group: str, source: str) -> str:
    if not weights:
        return "dense"
    bits, kind = weights.get("num_bits"), str(weights.get("type", "int")).lower()
    group_size, strategy = weights.get("group_size"), str(weights.get("strategy") or "").lower()
    if kind == "float" and bits == 4 and group_size == 16:
        return "nvfp4"
    if kind == "float" and bits == 4 and group_size == 32:
        return "mxfp4"
    if kind == "float" and bits == 8 and strategy in ("channel", "tensor", "block", ""):
        return "fp8"  # a block's scales: their shape says the block (layout.fp8_block_of)
    raise CheckpointError(
        f"unsupported compressed-tensors weight scheme in config group {group!r} (num_bits={bits}, "
        f"type={kind}, strategy={strategy or None}, group_size={group_size}); radiance reads nvfp4 "
        "(fp4, group 16), mxfp4 (fp4, group 32) and fp8 per-channel/per-tensor/per-block", file=source)


def _ct_fp8_scales(weights, fmt: str) -> tuple[str, tuple[int, int] | None]:
    """(QuantScheme.scales, .block) of a compressed-tensors fp8 weight scheme."""
    if fmt != "fp8" or not isinstance(weights, dict):
        return "", None
    strategy = str(weights.get("strategy") or "").lower()
    if strategy in ("channel", "tensor"):
        return "rows", None
    block = weights.get("block_structure")
    if strategy == "block" and _is_block(block):
        return "block", (block[0], block[1])
    return ("block" if strategy == "block" else ""), None


def _is_block(block) -> bool:
    return (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def _parse_compressed_tensors(qc: dict, source: str) -> QuantSpec:
    storage = str(qc.get("format") or "")
    groups = qc.get("config_groups")
    if groups is not None and not isinstance(groups, dict):
        raise CheckpointError(f"compressed-tensors config_groups must be an object of named groups, got "
                              f"{type(groups).__name__}", file=source)
    if not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups", file=source)
    schemes, warnings = [], []
    for name, group in groups.items():
        if isinstance(group, list):  # preset name -> targets
            weights = _CT_PRESET_WEIGHTS.get(name.upper())
            if weights is None:
                raise CheckpointError(f"unsupported compressed-tensors preset scheme {name!r}; radiance reads "
                                      f"{', '.join(_CT_PRESET_WEIGHTS)}", file=source)
            targets, group_storage = group, storage
        elif isinstance(group, dict):
            weights = group.get("weights")
            targets, group_storage = group.get("targets") or [], str(group.get("format") or storage)
        else:
            raise CheckpointError(f"config group {name!r} must be an object", file=source)
        fmt = _ct_format(weights, name, source)
        if group_storage == "dense":
            fmt = "dense"  # quantization parameters present but weights saved decompressed
        elif fmt != "dense" and group_storage not in ("", "mixed-precision") + _CT_STORAGE[fmt]:
            raise CheckpointError(f"config group {name!r} holds {fmt} weights but its storage format is "
                                  f"{group_storage!r} (expected {' or '.join(_CT_STORAGE[fmt])})", file=source)
        if not isinstance(targets, list):
            raise CheckpointError(f"config group {name!r}: targets must be a list of module names or patterns, got "
                                  f"{type(targets).__name__}", file=source)
        if not targets:
            raise CheckpointError(f"config group {name!r} has no targets", file=source)
        scales, block = _ct_fp8_scales(weights, fmt)
        schemes.append(QuantScheme(fmt, "compressed-tensors", tuple(targets), name, scales, block))
        activations = group.get("input_activations") if isinstance(group, dict) else None
        if isinstance(activations, dict) and activations.get("num_bits") == 4:
            warnings.append(f"config group {name!r} declares 4-bit input activations (W4A4, {source}): radiance "
                            "serves its weights with fp8 activations per token (W4A8), more exact than its "
                            "calibration assumed")
    return QuantSpec(method="compressed-tensors", storage=storage, schemes=tuple(schemes), source=source,
                     warnings=warnings)


def _quark_format(spec: dict | None, where: str, source: str) -> str:
    weight = spec.get("weight") if isinstance(spec, dict) else None
    if weight is None:
        return "dense"
    if isinstance(weight, dict):
        dtype, qscheme = weight.get("dtype"), weight.get("qscheme")
        if (dtype == "fp4" and qscheme == "per_group" and weight.get("group_size") == 32
                and weight.get("scale_format") == "e8m0"):
            return "mxfp4"
        if dtype == "fp8_e4m3" and qscheme in ("per_channel", "per_tensor"):
            return "fp8"
    raise CheckpointError(f"unsupported Quark weight scheme in {where}: {weight!r}; radiance reads OCP MX fp4 "
                          "(per_group 32, e8m0) and fp8_e4m3 per-channel/per-tensor", file=source)


def _parse_quark(qc: dict, source: str) -> QuantSpec:
    global_cfg = qc.get("global_quant_config")
    layer_cfg = qc.get("layer_quant_config") or {}
    type_cfg = qc.get("layer_type_quant_config") or {}
    def scheme(cfg, where: str, targets: tuple, group: str) -> QuantScheme:
        fmt = _quark_format(cfg, where, source)
        return QuantScheme(fmt, "quark", targets, group, "rows" if fmt == "fp8" else "")  # per channel / tensor

    schemes = tuple(scheme(cfg, f"layer_quant_config[{pattern!r}]", (pattern,), pattern)
                    for pattern, cfg in layer_cfg.items())
    types = {name: scheme(cfg, f"layer_type_quant_config[{name!r}]", (), name) for name, cfg in type_cfg.items()}
    global_scheme = scheme(global_cfg, "global_quant_config", (), "global") if global_cfg else None
    return QuantSpec(method="quark", storage="quark", schemes=schemes, type_schemes=types,
                     global_scheme=global_scheme, source=source)


def _parse_hf_fp8(qc: dict, source: str) -> QuantSpec:
    """transformers' FineGrainedFP8 layout: every linear e4m3 with a `weight_scale_inv` per weight_block_size block
    (activations quantized per token at run time, as radiance does them anyway)."""
    block = qc.get("weight_block_size")
    if not _is_block(block):
        raise CheckpointError(f"fp8 quantization_config weight_block_size must be two positive integers (rows, K), "
                              f"got {block!r}", file=source)
    scheme = QuantScheme("fp8", "hf-fp8", ("Linear",), f"fp8 {block[0]}x{block[1]}", "block", (block[0], block[1]))
    return QuantSpec(method="fp8", storage=f"fp8 (blocks of {block[0]} x {block[1]})", schemes=(scheme,),
                     source=source)


# ModelOpt quant_algo -> (our format, the group size it must declare, None: any)
_MODELOPT_ALGOS = {"NVFP4": ("nvfp4", 16), "FP8": ("fp8", None)}


def _parse_modelopt(qc: dict, source: str) -> QuantSpec:
    algo = str(qc.get("quant_algo") or "").upper()
    if algo not in _MODELOPT_ALGOS:
        raise CheckpointError(f"unsupported ModelOpt quant_algo {qc.get('quant_algo')!r}; radiance reads "
                              f"{' and '.join(_MODELOPT_ALGOS)} (one algorithm for every linear)", file=source)
    fmt, group = _MODELOPT_ALGOS[algo]
    if group is not None and qc.get("group_size", group) != group:
        raise CheckpointError(f"ModelOpt {algo} with group_size {qc.get('group_size')} (expected {group})",
                              file=source)
    scheme = QuantScheme(fmt, "modelopt", ("Linear",), algo, "rows" if fmt == "fp8" else "")
    return QuantSpec(method="modelopt", storage=algo, schemes=(scheme,), source=source)
