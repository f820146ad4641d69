"""Loading models for `eval`, through the engine's loader, so it measures exactly what the engine would serve.
(`bench engine` builds synthetic models itself: they have no tokenizer to evaluate with.)"""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar

import torch

from radiance.bench.quality import Variant, stored_linear_formats
from radiance.bench.synthetic import is_synthetic
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

# model -> its opened checkpoint, within shared_checkpoints()
_SHARED: ContextVar[dict | None] = ContextVar("eval_checkpoints", default=None)


@contextlib.contextmanager
def shared_checkpoints():
    """Within it, open_eval_checkpoint opens each model once: `eval` tokenizes the text with, and loads the
    reference and every variant from, one reader, whose tokenizer is built once (the reader caches it). Each had
    opened the checkpoint and built the tokenizer again (~0.5 s each for the embedded GGUF; kl did it three times).
    A reader keeps no state a load changes (its index, plan and tokenizer are fixed at open), so loads share it."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def open_eval_checkpoint(model: str | None):
    """The checkpoint of `model`: the one already open within shared_checkpoints(), else opened now."""
    from radiance.checkpoint import open_checkpoint

    opened = _SHARED.get()
    if opened is None:
        return open_checkpoint(model)
    if model not in opened:
        opened[model] = open_checkpoint(model)
    return opened[model]


def load_eval_tokenizer(model: str | None, device: str | None):
    """The checkpoint's tokenizer alone: its headers and vocabulary read, no weights (run_eval's tokenizer_loader).
    Within shared_checkpoints() the models then load from the checkpoint opened here, with this tokenizer."""
    from radiance.engine.devices import resolve_device

    resolve_device(device)  # a bad --device is still the first error, as when the model loaded first
    if is_synthetic(model):
        raise ConfigError("synthetic models have no tokenizer; evaluate a real checkpoint (or omit MODEL)")
    return open_eval_checkpoint(model).tokenizer()


def eval_context_length(model: str | None) -> int | None:
    """The model's context in tokens from its config alone (run_eval's context_of; the checkpoint opened once
    within shared_checkpoints())."""
    return open_eval_checkpoint(model).resolve_architecture()[1].context_length


def load_eval_model(model: str | None, variant: Variant, device: str | None, dtype: str | None,
                    progress: bool = True):
    """(model with forward_logits, tokenizer) for one variant; the signature quality.run_eval expects. The bar
    shows the load: quantizing at load takes minutes on a CPU (the embedded model's 120 linears to MXFP4). The
    model's `stored_formats` names the stored format of each linear, for its label (a dequantized MXFP4 checkpoint is
    not the 16-bit model)."""
    from radiance.engine.devices import resolve_device
    from radiance.engine.loader import load_model

    resolve_device(device)  # a bad --device: one line before the model loads (not a torch traceback)
    if is_synthetic(model):
        raise ConfigError("synthetic models have no tokenizer; evaluate a real checkpoint (or omit MODEL)")
    checkpoint = open_eval_checkpoint(model)
    loaded = load_model(variant.model_config(model, device, dtype), variant.kernel_config(), checkpoint=checkpoint,
                        progress=progress)
    loaded.model.stored_formats = stored_linear_formats(checkpoint)
    if variant.kv_cache == "fp8":  # eval runs without a cache: attention reads K/V rounded as one would store them
        for attn in loaded.model.attention_layers():
            attn.kv_storage_dtype = torch.float8_e4m3fn
    logger.info("eval %s: %s", variant.label, " | ".join(loaded.summary[1:]))
    return loaded.model, loaded.tokenizer

