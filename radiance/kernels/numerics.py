"""Runtime numerics check: while serving, compare some kernel outputs with the exact reference.

Enabled by KernelConfig.numerics_check; checks one call in `numerics_check_every` per layer, never
inside CUDA-graph capture or torch.compile tracing (the check needs a host sync).
"""

from __future__ import annotations

import logging

import torch

from radiance.kernels import reference

log = logging.getLogger(__name__)
TOLERANCE = 2e-3


class NumericsMonitor:
    def __init__(self, name: str, every: int):
        self.name = name
        self.every = every
        self.calls = 0
        self.checks = 0
        self.failures = 0
        self.worst = 0.0

    def due(self) -> bool:
        if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return False
        self.calls += 1
        return (self.calls - 1) % self.every == 0

    def check(self, x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor) -> float:
        """Compare `out` with the reference on the same quantized activations; log above 2e-3."""
        ref = reference.w4a8_matmul_reference(x_q, x_scale, w, bias, out.dtype)
        err = reference.relative_error(out, ref)
        self.checks += 1
        self.worst = max(self.worst, err) if err == err else float("inf")
        if not err <= TOLERANCE:
            self.failures += 1
            log.warning("numerics check: %s M=%d rel error %.2e > %.0e vs the exact reference",
                        self.name, x_q.shape[0], err, TOLERANCE)
        return err
