"""The MoE routing kernel alone on the GPU: us per call (graph replays of 16 calls on fresh logits) at decode token
counts, for each setting of the routing module's switches, alternated twice.

    python3 tools/route_bench.py [--tokens 1 2 4 8 16] [--models 128x8 32x4]

Switches (radiance.kernels.moe_routing): ROUTE_ONE_BLOCK (phases in registers when one block holds every pair) and
ROUTE_ONE_WARP_MAX_TOKENS (tokens up to which one warp routes; 4 warps above).
"""

from __future__ import annotations

import argparse

import torch

from radiance.kernels import moe_routing as moe
from radiance.kernels.timing import time_us

VARIANTS = {  # name: the SWITCHES' values
    "blocked": (False, 2),
    "one-block (production)": (True, 2),
    "one-block, one warp up to 8 tokens": (True, 8),
}
SWITCHES = ("ROUTE_ONE_BLOCK", "ROUTE_ONE_WARP_MAX_TOKENS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--models", nargs="+", default=["128x8", "32x4"], help="experts x top_k")
    p.add_argument("--block-m", type=int, default=16, help="routing tile (the grouped GEMM's decode tile: 16)")
    args = p.parse_args()
    saved = tuple(getattr(moe, switch) for switch in SWITCHES)
    print("| experts x top_k | tokens | " + " | ".join(VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    try:
        for spec in args.models:
            experts, top_k = map(int, spec.split("x"))
            for tokens in args.tokens:
                logits = [torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(16)]
                times = {name: [] for name in VARIANTS}
                for _ in range(2):
                    for name, values in VARIANTS.items():
                        for switch, value in zip(SWITCHES, values):
                            setattr(moe, switch, value)
                        times[name].append(time_us([lambda x=x: moe.route_tokens(x, top_k, True, args.block_m)
                                                    for x in logits]))
                print(f"| {spec} | {tokens} | "
                      + " | ".join(" / ".join(f"{t:.2f}" for t in v) for v in times.values()) + " |", flush=True)
    finally:
        for switch, value in zip(SWITCHES, saved):
            setattr(moe, switch, value)


if __name__ == "__main__":
    main()
