"""Loads a model from a checkpoint (radiance.checkpoint.base.Checkpoint: `open_checkpoint`'s readers, or the
benchmarks' synthetic one) into the engine's module tree. `.tokenizer()` may return None (a synthetic checkpoint:
token-id prompts only) or raise CheckpointError (a reader that cannot build one)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from radiance.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig, SchedulerConfig
from radiance.checkpoint import model_name
from radiance.checkpoint.report import RequantReport
from radiance.checkpoint.sampling_defaults import SamplingDefaults, read_sampling_defaults
from radiance.formats._checks import nonfinite_count
from radiance.engine.devices import resolve_device, resolve_dtype
from radiance.engine.kv_cache import (blocks_known_before_load, check_kv_capacity, check_max_model_len, kv_cache_dtype,
                                      kv_capacity)
from radiance.engine.kv_layout import KvLayout
from radiance.engine.linears import Overflow16Bit, build_linear, build_lm_head, to_serving_dtype
from radiance.errors import CheckpointError
from radiance.formats import DenseWeight
from radiance.layers.linear import DenseLinear, UnloadedLinear
from radiance.models.registry import parameter_name

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None
    chat_template: str | None
    eos_token_ids: list[int]
    name: str
    device: torch.device
    dtype: torch.dtype
    summary: list[str] = field(default_factory=list)
    chat_templates: dict[str, str] = field(default_factory=dict)  # by name: "default", "tool_use", ...
    tokenizer_error: str | None = None  # why `tokenizer` is None (file and field), for the errors of text prompts
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # its generation_config.json's


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


def load_model(config: EngineConfig | ModelConfig, kernel_config: KernelConfig | None = None,
               checkpoint=None, progress: bool = True) -> LoadedModel:
    if isinstance(config, EngineConfig):
        model_config, kernel_config, cache_config = config.model, kernel_config or config.kernel, config.cache
    else:  # a model alone: no cache settings to check before the load
        model_config, kernel_config, cache_config = config, kernel_config or KernelConfig(), None
    device = resolve_device(model_config.device)
    dtype = resolve_dtype(model_config.dtype, device)
    torch.manual_seed(model_config.seed)
    checkpoint, model_class, arch = open_for_loading(model_config, cache_config, checkpoint)
    started = time.perf_counter()
    with _default_dtype_and_device(dtype, device):
        model = model_class(arch)
    model.eval()
    served, report, kv_scales_note = _load_weights(model, checkpoint, model_config, kernel_config, dtype, device,
                                                   progress)
    tokenizer, tokenizer_error = _load_tokenizer(checkpoint)
    name = _model_name(model_config.model, checkpoint.path)
    summary = [
        f"model: {checkpoint.path or name} ({model.config.architecture}, {model.config.num_layers} layers, hidden "
        f"{model.config.hidden_size}) on {device} in {str(dtype).replace('torch.', '')}, loaded in "
        f"{time.perf_counter() - started:.1f} s",
        *_served_summary(served, report, kv_scales_note, model_config.quantization),
        *_kernel_summary(model),
    ]
    for line in summary:
        logger.info(line)
    eos = list(checkpoint.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(model, tokenizer, checkpoint.chat_template, eos, str(name),
                       device, dtype, summary, dict(checkpoint.chat_templates),
                       tokenizer_error, read_sampling_defaults(checkpoint.path))


def _load_weights(model, checkpoint, model_config: ModelConfig, kernel_config: KernelConfig, dtype: torch.dtype,
                  device: torch.device, progress: bool) -> tuple[Counter, RequantReport, str | None]:
    """Every checkpoint tensor into `model`: 16-bit parameters copied, linears built in their serving format; then
    a tied head's stored copy compared, a quantized head's own copy, the KV scales, and what the checkpoint lacks.
    Gives how many linears each format serves, the requantization report and the KV scales' note."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    served = Counter()
    report = RequantReport(target_format="mxfp4", rule=model_config.rule)

    def record(name: str, source_format: str, how: str, err: float) -> None:
        served[how] += 1
        if how in ("mxfp4", "mxfp4x2") and source_format != "mxfp4":
            report.add(name, source_format, err, target_format=how)
        else:
            dequantized = how.removesuffix("-dequant")  # the format whose values it serves in 16 bit
            report.keep(name, f"{dequantized} (dequantized)" if dequantized != how else source_format)

    stored_head = None  # a tied model's lm_head.weight: compared with the embeddings once they are in
    linears: list[tuple[str, int]] = []  # (name, partitions) of the linears built, for the ignore patterns' check
    for name, item in checkpoint.iter_weights(progress=progress):
        if isinstance(item, torch.Tensor):
            target = parameter_name(name)
            if target == "lm_head.weight" and model.config.tie_word_embeddings:
                stored_head = item
                continue
            if target == "lm_head.weight" and model_config.quantize_lm_head:
                name, item = "lm_head", DenseWeight(item)  # served like any other linear below
            else:
                _copy_parameter(params.get(target), name, item, checkpoint)
                loaded.add(target)
                continue
        try:
            item = model.checkpoint_linear(name, item)
        except ValueError as exc:
            raise CheckpointError(str(exc), file=checkpoint.file_of(name), tensor=name) from None
        _, how, err = _install_linear(model, name, item, model_config, kernel_config, dtype, device, checkpoint)
        linears.append((name, len(item.partition_sizes)))
        if name == "lm_head":  # a quantized head replaces the 16-bit weight slot
            loaded.add("lm_head.weight")
            model.lm_head.weight = None
        record(name, item.format, how, err)
    if stored_head is not None:
        _warn_if_the_stored_head_differs(stored_head, model, checkpoint)
    if model_config.quantize_lm_head and model.lm_head.tied_to is not None and model.lm_head.linear is None:
        # the head gets its own quantized copy; token lookups keep the 16-bit embedding
        tied = DenseWeight(model.lm_head.tied_to.weight.detach())
        _, how, err = _install_linear(model, "lm_head", tied, model_config, kernel_config, dtype, device, checkpoint)
        record("lm_head", "dense", how, err)
    _warn_unmatched_ignore(model_config.ignore, linears, checkpoint.path)
    kv_scales_note = _install_kv_scales(model, checkpoint.attention_scales, checkpoint)
    missing = [n for n in params if n not in loaded]
    missing += [n for n, m in model.named_modules() if isinstance(m, UnloadedLinear)]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} weight(s) the model needs, e.g. {missing[:3]}",
                              file=checkpoint.path)
    for module in model.modules():  # e.g. a sparse MLP stacks its experts for the grouped kernel
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    return served, report, kv_scales_note


def _warn_unmatched_ignore(patterns: tuple[str, ...], linears: list[tuple[str, int]], path: str | None) -> None:
    """A ModelConfig.ignore pattern that selected no linear did nothing: say so, as `radiance convert` does."""
    if not patterns:
        return
    from radiance.checkpoint.convert import IgnoreSelection
    selection = IgnoreSelection(patterns)
    for name, partitions in linears:
        selection(name, partitions)
    selection.warn_unmatched(path or "the checkpoint")


def _served_summary(served: Counter, report: RequantReport, kv_scales_note: str | None, quantization: str) -> list[str]:
    """The load summary's lines on how the weights are served: linears per format, requantization, KV scales."""
    lines = ["linears: " + ", ".join(f"{n} {how}" for how, n in sorted(served.items()))
             + f" (quantization={quantization})"]
    if report.entries:
        lines.append("requant: " + report.summary())
    if kv_scales_note:
        lines.append(kv_scales_note)
    return lines


def _copy_parameter(param: torch.nn.Parameter | None, name: str, item: torch.Tensor, checkpoint) -> None:
    """A 16-bit tensor into its parameter, refused where the model has no such parameter, its shape differs or a
    value is not finite."""
    if param is None:  # by the checkpoint's own name (q_proj.bias, not the merged qkv_proj.bias)
        stored = checkpoint.stored_name(name)
        raise CheckpointError("tensor not used by the model", file=checkpoint.file_of(stored), tensor=stored)
    if tuple(param.shape) != tuple(item.shape):
        raise CheckpointError(f"shape {tuple(item.shape)} does not match the model's {tuple(param.shape)}",
                              file=checkpoint.file_of(name), tensor=checkpoint.stored_name(name))
    param.data.copy_(_cast_named(item, param.dtype, name, checkpoint))
    bad = nonfinite_count(param.data)  # on the device: nearly free on a GPU
    if bad:
        raise _nonfinite_error(bad, name, checkpoint)


def open_for_loading(model_config: ModelConfig, cache_config: CacheConfig | None = None, checkpoint=None):
    """(checkpoint, model class, ArchConfig): the model opened (unless given) and what its config alone can refuse
    checked (an architecture radiance does not serve, a max_model_len past its context or past a KV cache whose size
    is known before the load), so each is one line before minutes of weights load; `radiance serve` calls it before
    it binds its port."""
    if checkpoint is None:
        from radiance.checkpoint import open_checkpoint
        checkpoint = open_checkpoint(model_config.model)
    model_class, arch = checkpoint.resolve_architecture()
    check_max_model_len(model_config.max_model_len, arch.context_length, _context_source(checkpoint, arch))
    if cache_config is not None:
        device = resolve_device(model_config.device)
        _check_known_kv_capacity(model_config.max_model_len, arch, cache_config, device,
                                 resolve_dtype(model_config.dtype, device))
    return checkpoint, model_class, arch


def _check_known_kv_capacity(requested: int | None, arch, cache, device: torch.device, dtype: torch.dtype) -> None:
    """check_kv_capacity where the block count needs no weights (the CPU's byte budget, a block override): a refusal
    before the load rather than after it. On CUDA without an override the runner checks once the memory is known."""
    layout = KvLayout.of(arch, cache.hybrid_kv_cache)
    blocks = blocks_known_before_load(arch, cache, device, kv_cache_dtype(device, dtype, cache.kv_cache_dtype), layout)
    if blocks is not None:
        # the default step budget: a larger one is refused by the runner's own check (it knows the scheduler's)
        capacity = kv_capacity(blocks, cache.block_size, layout, SchedulerConfig().max_num_batched_tokens, requested)
        check_kv_capacity(requested, blocks, cache.block_size, cache, device.type, capacity)


def _context_source(checkpoint, arch) -> str:
    """Where the model's context (ArchConfig.context_length) comes from, for the error that names it."""
    if arch.context_length != arch.max_position_embeddings:
        return "YaRN's original_max_position_embeddings x factor"
    if checkpoint.kind == "gguf":
        return "the GGUF's context_length"
    if checkpoint.config.get("max_position_embeddings") is None:
        return "transformers' default max_position_embeddings: config.json gives none"
    return "max_position_embeddings in config.json"


def _load_tokenizer(checkpoint) -> tuple[object | None, str | None]:
    """(tokenizer, None), or (None, why not): a weights-only directory or a GGUF whose tokenizer cannot be built
    still serves token-id prompts, and the reason is kept for the error a text prompt gets later (the warning
    here scrolls away behind the load's log lines)."""
    try:
        return checkpoint.tokenizer(), None
    except CheckpointError as exc:
        logger.warning("no tokenizer (%s): only token-id prompts can be served", exc)
        return None, str(exc)


def no_tokenizer_message(reason: str | None, hint: str) -> str:
    """The error a text prompt gets from a model without a tokenizer: the cause when known, then what works."""
    return f"this model has no tokenizer: {reason}; {hint}" if reason else f"this model has no tokenizer: {hint}"


def _install_kv_scales(model, scales: dict[str, float], checkpoint) -> str | None:
    """The checkpoint's calibrated fp8 KV-cache scales onto each layer's Attention (KvScales); a summary line."""
    from radiance.layers.attention import Attention, KvScales

    layers: dict[str, dict[str, float]] = {}
    for name, value in scales.items():
        module, _, kind = name.rpartition(".")
        layers.setdefault(module, {})[kind] = value
    for module, found in layers.items():
        try:
            attn = next(m for m in model.get_submodule(module).modules() if isinstance(m, Attention))
        except (AttributeError, StopIteration):
            raise CheckpointError("attention scale of no attention layer of the model",
                                  file=checkpoint.path,
                                  tensor=f"{module}.{next(iter(found))}") from None
        attn.fp8_kv_scales = KvScales(found.get("k_scale", 1.0), found.get("v_scale", 1.0))
    if not layers:
        return None
    return (f"fp8 KV-cache scales: {len(layers)} of {model.config.num_layers} layers from the checkpoint "
            "(applied with --kv-cache-dtype fp8)")


def _overflow_message(exc: ValueError, dtype: torch.dtype) -> str:
    return f"cannot load it in {str(dtype).removeprefix('torch.')}: {exc} (--dtype bfloat16 holds it)"


def _cast_named(tensor: torch.Tensor, dtype: torch.dtype, name: str, checkpoint) -> torch.Tensor:
    """`tensor` ready to copy into a parameter of `dtype`; a finite value that would become inf there (a float32
    value above 65504 in float16) is a CheckpointError naming the tensor, not a model that answers NaN. Into
    other dtypes it goes as it is (the copy casts it, with no extra pass)."""
    if dtype != torch.float16:
        return tensor
    try:
        return to_serving_dtype(tensor, dtype)
    except Overflow16Bit as exc:
        raise CheckpointError(_overflow_message(exc, dtype), file=checkpoint.file_of(name),
                              tensor=checkpoint.stored_name(name)) from None


def _warn_if_the_stored_head_differs(stored: torch.Tensor, model, checkpoint) -> None:
    """tie_word_embeddings with an lm_head.weight stored beside the embeddings: the embeddings serve as the head, as
    vLLM serves them. transformers 5 serves the stored head when it differs (a tie flag set wrongly), so say so."""
    from radiance.checkpoint.values import stored_head_differs

    if not stored_head_differs(stored, model.lm_head.tied_to.weight):
        return
    logger.warning("config.json sets tie_word_embeddings, but %s also stores an lm_head.weight that differs from the "
                   "embeddings: the embeddings serve as the head (as in vLLM; transformers 5 serves the stored head). "
                   "If the tie flag is wrong, set \"tie_word_embeddings\": false",
                   checkpoint.file_of("lm_head.weight"))


def _nonfinite_error(count: int, name: str, checkpoint) -> CheckpointError:
    """A NaN or inf in a 16-bit weight: named at load, not a model that answers garbage."""
    return CheckpointError(f"{count} NaN or inf value(s) in the weight (a corrupt file or a broken conversion)",
                           file=checkpoint.file_of(name), tensor=checkpoint.stored_name(name))


def _model_name(requested: str | None, path: str | None) -> str:
    """The name the server lists: the embedded model's when none was asked for and the file is a GGUF."""
    return model_name(requested if requested is not None or path is None or path.endswith(".gguf") else path)


def _install_linear(model, name, weight, model_config, kernel_config, dtype, device, checkpoint):
    if name == "lm_head":
        parent, leaf, expected = model.lm_head, "linear", (model.config.vocab_size, model.config.hidden_size)
        build = build_lm_head
    else:
        parent_name, leaf = name.rsplit(".", 1)
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            parent = None
        slot = getattr(parent, leaf, None) if parent is not None else None
        if not isinstance(slot, UnloadedLinear):
            raise CheckpointError("linear not used by the model", file=checkpoint.file_of(name), tensor=name)
        expected = (slot.out_features, slot.in_features)
        build = functools.partial(build_linear, name)
    if tuple(weight.shape) != expected:
        raise CheckpointError(f"linear shape {tuple(weight.shape)} does not match the model's {expected}",
                              file=checkpoint.file_of(name), tensor=name)
    from radiance.checkpoint.convert import culprit_tensor
    from radiance.formats import dequantize, weight_to
    try:
        module, how, err = build(weight_to(weight, device), model_config, kernel_config, dtype)
    except Overflow16Bit as exc:  # a 16-bit linear's value beyond float16: the partition holding it, named
        culprit = culprit_tensor(name, DenseWeight(dequantize(weight).to(dtype), weight.partition_sizes))
        raise CheckpointError(_overflow_message(exc, dtype), file=checkpoint.file_of(culprit),
                              tensor=checkpoint.stored_name(culprit)) from None
    except ValueError as exc:  # the codecs know no names (a NaN weight quantized at load): add them
        culprit = culprit_tensor(name, weight)
        raise CheckpointError(f"cannot load {name}: {exc}", file=checkpoint.file_of(culprit),
                              tensor=checkpoint.stored_name(culprit)) from None
    bad = nonfinite_count(module.weight) if isinstance(module, DenseLinear) else 0
    if bad:  # served as 16-bit values (a quantizer refuses NaN itself): the partition holding the first, named
        culprit = culprit_tensor(name, DenseWeight(module.weight, weight.partition_sizes))
        raise _nonfinite_error(bad, culprit, checkpoint)
    setattr(parent, leaf, module.to(device))
    return module, how, err


def _kernel_summary(model) -> list[str]:
    from radiance.layers.linear import linear_summary
    from radiance.layers.moe import moe_summary
    return [linear_summary(model)] + [line for line in (moe_summary(model),) if line]
