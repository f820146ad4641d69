"""Per-layer requantization error report, shared by `convert` and the engine's loader.

Each converted linear logs its relative RMS error (||W - Q(W)|| / ||W|| against the dequantized
source) at DEBUG; `summary()` is the one line users see: layers converted by kind, worst relRMS, seconds.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from radiance.checkpoint.names import layer_kind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequantEntry:
    name: str
    kind: str  # qkv_proj, o_proj, gate_up_proj, down_proj, lm_head, ...
    source_format: str
    target_format: str
    rel_rms: float


@dataclass
class RequantReport:
    """Collects one entry per converted linear; `summary()` gives the one-line result."""

    target_format: str = "mxfp4"
    rule: str | None = None
    log: logging.Logger = field(default=logger, repr=False)
    layer_level: int = logging.DEBUG
    entries: list[RequantEntry] = field(default_factory=list)
    kept: Counter = field(default_factory=Counter)  # linears left as they were, by format
    started: float = field(default_factory=time.perf_counter)

    def add(self, name: str, source_format: str, rel_rms: float, target_format: str | None = None) -> None:
        entry = RequantEntry(name, layer_kind(name), source_format, target_format or self.target_format,
                             float(rel_rms))
        self.entries.append(entry)
        self.log.log(self.layer_level, "%s: %s -> %s relRMS %.4f", name, entry.source_format,
                     entry.target_format, entry.rel_rms)

    def keep(self, name: str, fmt: str) -> None:
        """A linear that was not converted (already in the target format, or kept 16-bit)."""
        self.kept[fmt] += 1
        self.log.log(self.layer_level, "%s: kept as %s", name, fmt)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def worst(self) -> RequantEntry | None:
        return max(self.entries, key=lambda e: e.rel_rms, default=None)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(e.kind for e in self.entries))

    def mean_rel_rms(self) -> float:
        return sum(e.rel_rms for e in self.entries) / len(self.entries) if self.entries else 0.0

    def summary(self) -> str:
        rule = f", rule {self.rule}" if self.rule else ""
        kept = "; kept " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.kept.items())) if self.kept else ""
        if not self.entries:
            return f"converted 0 linears to {self.target_format}{kept} in {self.seconds:.1f} s"
        sources = "+".join(sorted({e.source_format for e in self.entries}))
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.by_kind().items())
        worst = self.worst
        return (f"converted {len(self.entries)} linears {sources} -> {self.target_format}{rule} ({kinds}){kept}; "
                f"relRMS mean {self.mean_rel_rms():.4f}, worst {worst.rel_rms:.4f} ({worst.name}); "
                f"{self.seconds:.1f} s")
