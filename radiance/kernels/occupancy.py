"""At most N CTAs of one launch per SM, set through the dynamic shared memory the launch asks for.

Why: a decode GEMM launched as a programmatic dependent (PDL) gets its CTAs placed on the SMs that free first, up
to 5 per SM where an even ceil(CTAs / SMs) would do (bench/RESULTS.md, fifth, seventh and thirty-second sessions).
Asking for enough shared memory that no more than that even share fits on an SM leaves the hardware no other
placement: on the H200 the 8B's decode step went 2.346 -> 2.262 ms at batch 8 and 2.942 -> 2.833 at batch 32
(bytes equal; batch 1 and the 32B unchanged within 0.2%).

Triton has no launch option for this, so the compiled kernel's launch metadata (num_warps, num_ctas, shared bytes)
is patched for the launches inside `ctas_per_sm_at_most` and restored after; above 48 KB the launch needs the
kernel's function loaded with the opt-in limit, which Triton's own `load_binary` sets up when asked for more than
48 KB. Where Triton's internals are not what this expects (another version), nothing is patched.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from radiance.kernels.device_info import shared_memory_limits

logger = logging.getLogger(__name__)

RESERVED_PER_CTA = 1024  # shared memory the hardware keeps per resident CTA (sm_80 and later)
DEFAULT_DYNAMIC_LIMIT = 48 * 1024  # dynamic shared memory a function may take before it opts in to more
_MARGIN = 256  # over the (cap + 1)-th CTA's share by this much: allocation granularity is 128 bytes
_opt_in_functions: dict[int, object] = {}  # id(compiled kernel) -> its function loaded with the opt-in limit


def shared_bytes_for_cap(cap: int, own: int, per_sm: int, optin: int) -> int:
    """Dynamic shared memory a CTA that needs `own` bytes asks for so that at most `cap` of them fit on an SM
    with `per_sm` bytes: `own` when that already holds or when the cap would need more than `optin`."""
    if cap < 1:
        raise ValueError(f"a cap of {cap} CTAs per SM")
    want = per_sm // (cap + 1) - RESERVED_PER_CTA + _MARGIN
    return want if own < want <= optin else own


def ctas_per_sm(shared: int, per_sm: int) -> int:
    """How many CTAs asking for `shared` bytes fit on an SM by shared memory alone."""
    return per_sm // (shared + RESERVED_PER_CTA)


def _patchable(compiled) -> bool:
    """Whether the compiled kernel looks as this module expects (loading it first: a kernel from
    `run(..., warmup=True)` has no function handle yet)."""
    load = getattr(compiled, "_init_handles", None)
    if callable(load):
        load()
    packed = getattr(compiled, "packed_metadata", None)
    return (isinstance(packed, tuple) and len(packed) == 3 and isinstance(getattr(compiled, "function", None), int)
            and isinstance(getattr(getattr(compiled, "metadata", None), "shared", None), int))


def _opt_in_function(compiled, device: torch.device):
    """The compiled kernel's function loaded again with the opt-in dynamic shared memory limit (once)."""
    if id(compiled) not in _opt_in_functions:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        # asked for more than the default limit, Triton's loader opts the function in to the device's maximum
        _, function, *_ = driver.active.utils.load_binary(compiled.name, compiled.kernel, DEFAULT_DYNAMIC_LIMIT + 1,
                                                          index)
        _opt_in_functions[id(compiled)] = function
    return _opt_in_functions[id(compiled)]


@contextlib.contextmanager
def ctas_per_sm_at_most(compiled, cap: int, device: torch.device):
    """Launches of `compiled` (a Triton CompiledKernel, e.g. from `kernel.run(..., warmup=True)`) inside ask for
    the shared memory that fits at most `cap` of its CTAs per SM."""
    limits = shared_memory_limits(device)
    if limits is None or not _patchable(compiled):
        logger.debug("no occupancy cap for %s: device limits or Triton's kernel metadata unknown",
                     getattr(compiled, "name", compiled))
        yield
        return
    own = compiled.metadata.shared
    shared = shared_bytes_for_cap(cap, own, *limits)
    if shared == own:
        yield
        return
    saved = compiled.packed_metadata, compiled.function
    num_warps, num_ctas, _ = saved[0]
    try:
        if shared > DEFAULT_DYNAMIC_LIMIT:
            compiled.function = _opt_in_function(compiled, device)
        compiled.packed_metadata = (num_warps, num_ctas, shared)
        yield
    finally:
        compiled.packed_metadata, compiled.function = saved
