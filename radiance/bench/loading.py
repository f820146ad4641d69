"""Loading models for the measuring commands, through the engine's loader (so `eval` measures
exactly what the engine would serve). Synthetic names (`synthetic:llama-3.1-8b`) build random
weights on the device instead of opening a checkpoint."""

from __future__ import annotations

import logging

import torch

from radiance.bench.quality import Variant
from radiance.bench.synthetic import SyntheticCheckpoint, is_synthetic
from radiance.config import KernelConfig, ModelConfig
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def open_model_source(model: str | None, device: str | None, dtype: str | None):
    """A SyntheticCheckpoint for synthetic names, else None (the loader opens the path itself)."""
    if not is_synthetic(model):
        return None
    from radiance.engine.loader import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return SyntheticCheckpoint(model, device=dev, dtype=resolve_dtype(dtype, dev))


def check_device(device: str | None) -> None:
    """A --device torch can use, as one error line: the loader hands the string to torch, whose answer for
    "gpu0" or for "cuda" on a machine without one is a traceback."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA GPU here (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")


def load_eval_model(model: str | None, variant: Variant, device: str | None, dtype: str | None):
    """(model with forward_logits, tokenizer) for one variant; the signature quality.run_eval expects."""
    from radiance.engine.loader import load_model

    check_device(device)
    if is_synthetic(model):
        raise ConfigError("synthetic models have no tokenizer; evaluate a real checkpoint (or omit MODEL)")
    model_config = ModelConfig(model=model, quantization=variant.quantization, rule=variant.rule,
                               quantize_lm_head=variant.lm_head is not None,
                               lm_head_format=variant.lm_head or "mxfp4", device=device, dtype=dtype)
    loaded = load_model(model_config, KernelConfig(activations=variant.activations), progress=False)
    if variant.kv_cache == "fp8":  # eval runs without a cache: attention reads K/V rounded as one would store them
        for attn in loaded.model.attention_layers():
            attn.kv_storage_dtype = torch.float8_e4m3fn
    logger.info("eval %s: %s", variant.label, " | ".join(loaded.summary[1:]))
    return loaded.model, loaded.tokenizer
