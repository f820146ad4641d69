"""Per-device scratch buffers that kernels reuse across calls (CUDA-graph safe: they only grow, and
the warm-up calls before any capture reach the sizes that matter, so no allocation happens inside one)."""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_buffer(name: str, device: torch.device, numel: int, dtype: torch.dtype, zeroed: bool) -> torch.Tensor:
    """A buffer of at least `numel` elements, kept per (name, device) and grown to the largest request.
    Launches on one stream run one after another, so every call may reuse it. `zeroed` buffers start
    at zero; a kernel that keeps counters in one must leave them as its next launch expects."""
    buf = _BUFFERS.get((name, device))
    if buf is None or buf.numel() < numel:
        _BUFFERS.pop((name, device), None)  # free the old one before allocating the larger
        buf = (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
        _BUFFERS[(name, device)] = buf
    return buf
