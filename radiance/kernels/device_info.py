"""What the launchers need to know about the device a tensor lives on."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _props(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    # the interpreter has no SMs; 4 keeps split-K exercised in CPU tests
    return _props(_index(device)).multi_processor_count if device.type == "cuda" else 4


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): sm_90 and later."""
    return device.type == "cuda" and _props(_index(device)).major >= 9


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device (cached: launchers ask on every call), None
    elsewhere."""
    if device.type != "cuda":
        return None
    props = _props(_index(device))
    return props.major, props.minor


# Hopper's 227 KiB of shared memory per block; Ada and consumer Ampere opt in to 99 KiB, A100 to 163
LARGE_SHARED_MEMORY = 200 * 1024


def large_shared_memory(device: torch.device) -> bool:
    """Whether a block may use Hopper-sized shared memory (the 128-row attention tiles' pipelines need
    more than Ada's 99 KiB). True under the interpreter, which has no limit, so tests run those tiles."""
    if device.type != "cuda":
        return True
    props = _props(_index(device))
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return optin >= LARGE_SHARED_MEMORY if optin is not None else props.major >= 9


def shared_memory_limits(device: torch.device) -> tuple[int, int] | None:
    """(bytes of shared memory per SM, the most one block may opt in to) of a CUDA device; None elsewhere or
    where torch does not report them."""
    if device.type != "cuda":
        return None
    props = _props(_index(device))
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return (per_sm, optin) if per_sm and optin else None
