"""The device and dtype a model is served on: what `--device` / `--dtype` resolve to, checked before any loading."""

from __future__ import annotations

import torch

from radiance.config import DTYPES
from radiance.errors import ConfigError

_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES, the names ModelConfig accepts


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device to run on (default: cuda when available, else cpu); one that cannot run here is a
    ConfigError of one line, checked before any loading (torch's own answers are tracebacks)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = _parse_device(device)
    if dev.type == "cuda":
        _check_cuda_index(device, dev.index)
    return dev


def _parse_device(device: str | torch.device) -> torch.device:
    """cpu or cuda[:N]: the device types the engine has kernels for."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r} is not one radiance runs on (cpu, cuda, cuda:1, ...)")
    return dev


def _check_cuda_index(device, index: int | None) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r}: torch sees no CUDA GPU here (use cpu)")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(f"device {str(device)!r}: torch sees {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The dtype asked for, else bfloat16 on CUDA and float32 on a CPU.

    bfloat16 decoded faster on some x86 CPUs (the embedded model: 20 against 25 ms per token on an AVX-512-BF16 CPU,
    44 against 56 on an AVX2-only one; 25.8 either way on a Xeon with AVX-512-BF16; bench/RESULTS.md), but its
    arithmetic differs between CPUs with native bf16 dot products and those that widen to fp32, enough to change
    greedy answers: on a Xeon with AVX-512-BF16 the embedded model answered "What is the capital of France?" with
    "L'Étoile, la Marseillaise," where float32 (and bf16 on an AVX2 EPYC) says Paris (thirty-fifth session).
    `--dtype bfloat16` keeps the bf16 path."""
    if dtype is not None:
        return _DTYPES[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32
