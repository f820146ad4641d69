"""Tile configurations of the W4A8 GEMM, read from a table in the repo (never re-autotuned at start).

`tuning/<table>.json` lists, per band ("decode", "prefill"), entries tried in order; the first whose
`shape` ("NxK" or "*") and optional `m_max` match the call wins. Its optional `expand_min_m` is the
token count from which the launcher expands the weight to fp8 and calls cuBLAS's fp8 GEMM instead;
its optional `unfused_glu_shapes` lists merged gate_up shapes ("NxK") whose SiLU-mul stays a launch of
its own (w4a8.w4a8_glu), where the fused epilogue measured slower; its optional `moe_expand_shapes` lists
the merged gate_up shapes of grouped experts that run expanded to fp8 on torch's grouped GEMM at prefill
sizes (moe_expanded.expand_serves), where that measured faster than the grouped W4A8 kernel. `radiance bench kernels --sweep`
measures candidates on the GPU and prints the entries to paste in.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radiance.kernels.device_info import capability
from radiance.kernels.triton_support import next_pow2

TUNING_DIR = Path(__file__).parent / "tuning"


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # token tile (MMA N when swap_ab)
    block_n: int  # weight-row tile (MMA M when swap_ab)
    block_k: int
    swap_ab: bool
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    split_k: int = 0  # 0 = choose from the SM count (decode); 1 = no split
    precise_acc: bool = True  # promote fp8 MMA partial sums to fp32 once per K tile

    def __post_init__(self):
        if self.block_k % 128:  # the kernel words come in 128-k groups (prepare.py)
            raise ValueError(f"block_k must be a multiple of 128, got {self.block_k}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")

    def as_dict(self) -> dict:
        return asdict(self)


# used when no table matches (other GPUs, CPU interpreter)
DEFAULT_DECODE = GemmConfig(block_m=16, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=4, split_k=0)
DEFAULT_PREFILL = GemmConfig(block_m=128, block_n=128, block_k=128, swap_ab=False, num_warps=8, num_stages=3, split_k=1)


def _table_name(device: torch.device) -> str | None:
    return "sm90" if capability(device) == (9, 0) else None


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict:
    path = TUNING_DIR / f"{name}.json"
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def expand_min_m(device: torch.device) -> int | None:
    """Token count from which the table says to expand weights to fp8 and use cuBLAS (None: never)."""
    name = _table_name(device)
    value = load_table(name).get("expand_min_m") if name else None
    return int(value) if value is not None else None


def glu_epilogue_serves(n: int, k: int, device: torch.device) -> bool:
    """Whether w4a8_glu runs the SiLU-mul in the gate_up GEMM's epilogue for this N x K weight."""
    name = _table_name(device)
    skip = load_table(name).get("unfused_glu_shapes", []) if name else []
    return f"{n}x{k}" not in skip


def moe_expand_listed(n: int, k: int, device: torch.device) -> bool:
    """Whether grouped experts whose merged gate_up weight is N x K are listed to run expanded to fp8."""
    name = _table_name(device)
    return f"{n}x{k}" in (load_table(name).get("moe_expand_shapes", []) if name else [])


def serving_entry_index(entries: list[dict], shape: str, m: int) -> int | None:
    """Index of the first of a band's `entries` that serves an "NxK" `shape` at M = m (None: no entry does)."""
    for i, entry in enumerate(entries):
        if entry.get("shape", "*") in ("*", shape) and (entry.get("m_max") is None or m <= entry["m_max"]):
            return i
    return None


def swap_ab_block_m(m: int) -> int:
    """The token tile of a swap-AB launch at M = m: M's power of two, 16 to 256 (the MMA's N dimension)."""
    return min(256, max(16, next_pow2(m)))


def select_config(m: int, n: int, k: int, decode_band: int, device: torch.device) -> GemmConfig:
    """The table's config for this call (decode band: M <= decode_band), with block_m fitted to M."""
    band = "decode" if m <= decode_band else "prefill"
    name = _table_name(device)
    entries = load_table(name).get(band, []) if name else []
    index = serving_entry_index(entries, f"{n}x{k}", m)
    if index is not None:
        chosen = GemmConfig(**entries[index]["config"])
    else:
        chosen = DEFAULT_DECODE if band == "decode" else DEFAULT_PREFILL
    if chosen.swap_ab:  # tokens are the MMA N dimension: fit the tile to M (16..256)
        fitted = swap_ab_block_m(m)
        block_m = fitted if band == "decode" else min(chosen.block_m, fitted)  # prefill: only shrink
        chosen = GemmConfig(**{**chosen.as_dict(), "block_m": block_m})
    return chosen
