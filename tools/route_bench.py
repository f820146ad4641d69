"""The MoE routing kernel alone on the GPU: us per call (graph replays of 16 calls on fresh logits) at decode token
counts, for each setting of the routing module's switches, alternated twice.

    python3 tools/route_bench.py [--tokens 1 2 4 8 16] [--models 128x8 32x4]

--dry-run (CPU, Triton interpreter) checks instead of timing that every setting of the switches routes alike: the
same expert ids and slot layout, weights within the renormalization's last ulp (tests/bench/test_route_bench.py).

Switches (radiance.kernels.moe_routing): ROUTE_ONE_BLOCK (phases in registers when one block holds every pair) and
ROUTE_ONE_WARP_MAX_TOKENS (tokens up to which one warp routes; 4 warps above).
"""

from __future__ import annotations

import argparse

import torch

from radiance import env
from radiance.kernels import moe_routing as moe
from radiance.kernels.timing import time_us

VARIANTS = {  # name: the SWITCHES' values
    "blocked": (False, 2),
    "one-block (production)": (True, 2),
    "one-block, one warp up to 8 tokens": (True, 8),
}
SWITCHES = ("ROUTE_ONE_BLOCK", "ROUTE_ONE_WARP_MAX_TOKENS")


def _set(values) -> None:
    for switch, value in zip(SWITCHES, values):
        setattr(moe, switch, value)


def check_alike(experts: int, top_k: int, tokens: int, block_m: int, device: str = "cpu") -> None:
    """Raises AssertionError unless every variant routes `tokens` random tokens as the first one does."""
    logits = torch.randn(tokens, experts, device=device) * 3  # fp32: no ties
    results = []
    for values in VARIANTS.values():
        _set(values)
        weights, ids, routing = moe.route_tokens(logits, top_k, True, block_m)
        results.append((weights, ids, routing.sorted_pairs, routing.tile_expert, routing.group_ends))
    (want_weights, *want), others = results[0], results[1:]
    for name, (weights, *got) in zip(list(VARIANTS)[1:], others):
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{name}: another routing than {list(VARIANTS)[0]}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--models", nargs="+", default=["128x8", "32x4"], help="experts x top_k")
    p.add_argument("--block-m", type=int, default=16, help="routing tile (the grouped GEMM's decode tile: 16)")
    p.add_argument("--dry-run", action="store_true", help="check on the CPU (Triton interpreter) instead of timing")
    args = p.parse_args(argv)
    if args.dry_run and not env.triton_interpret():
        raise SystemExit("--dry-run runs the Triton kernel on the CPU: set TRITON_INTERPRET=1")
    saved = tuple(getattr(moe, switch) for switch in SWITCHES)
    if not args.dry_run:
        print("| experts x top_k | tokens | " + " | ".join(VARIANTS) + " |")
        print("|---|---|" + "---|" * len(VARIANTS))
    try:
        for spec in args.models:
            experts, top_k = map(int, spec.split("x"))
            for tokens in args.tokens:
                if args.dry_run:
                    check_alike(experts, top_k, tokens, args.block_m)
                    print(f"{spec}, {tokens} tokens: every variant routes alike", flush=True)
                    continue
                logits = [torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(16)]
                times = {name: [] for name in VARIANTS}
                for _ in range(2):
                    for name, values in VARIANTS.items():
                        _set(values)
                        times[name].append(time_us([lambda x=x: moe.route_tokens(x, top_k, True, args.block_m)
                                                    for x in logits]))
                print(f"| {spec} | {tokens} | "
                      + " | ".join(" / ".join(f"{t:.2f}" for t in v) for v in times.values()) + " |", flush=True)
    finally:
        _set(saved)


if __name__ == "__main__":
    main()
