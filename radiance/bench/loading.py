"""Loading models for `eval`, through the engine's loader, so it measures exactly what the engine would serve.
(`bench engine` builds synthetic models itself: they have no tokenizer to evaluate with.)"""

from __future__ import annotations

import logging

import torch

from radiance.bench.quality import Variant
from radiance.bench.synthetic import is_synthetic
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def load_eval_model(model: str | None, variant: Variant, device: str | None, dtype: str | None,
                    progress: bool = True):
    """(model with forward_logits, tokenizer) for one variant; the signature quality.run_eval expects. The bar
    shows the load: quantizing at load takes minutes on a CPU (the embedded model's 120 linears to MXFP4)."""
    from radiance.engine.devices import resolve_device
    from radiance.engine.loader import load_model

    resolve_device(device)  # a bad --device: one line before the model loads (not a torch traceback)
    if is_synthetic(model):
        raise ConfigError("synthetic models have no tokenizer; evaluate a real checkpoint (or omit MODEL)")
    loaded = load_model(variant.model_config(model, device, dtype), variant.kernel_config(), progress=progress)
    if variant.kv_cache == "fp8":  # eval runs without a cache: attention reads K/V rounded as one would store them
        for attn in loaded.model.attention_layers():
            attn.kv_storage_dtype = torch.float8_e4m3fn
    logger.info("eval %s: %s", variant.label, " | ".join(loaded.summary[1:]))
    return loaded.model, loaded.tokenizer
