"""The CPU decode attention of one token over every layer of the embedded model's shape (30 layers, 9 query
heads, 3 KV heads, dim 64), through `paged_attention_torch` as the engine calls it: the cache in bf16 and
gathered every step (before the thirteenth session), in float32 and gathered, and in float32 read in place
(blocks in order, the engine's default on the CPU now). Each layer has its own cache, so the context
comes from memory, not from the CPU's caches, as in a real step (bench/RESULTS.md, thirteenth session).

    python3 tools/cpu_attention_bench.py [--context 300 2000] [--rounds 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from radiance.layers.attention import paged_attention_torch

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16
FIRST_BLOCK = 5


def variants(context: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, list[int] | None]]:
    blocks = FIRST_BLOCK + -(-context // BLOCK) + 1
    bf16 = torch.randn(2, LAYERS, blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    fp32 = bf16.float()
    return {"bf16 cache, gathered": (bf16, None), "float32 cache, gathered": (fp32, None),
            "float32 cache, in place": (fp32, [FIRST_BLOCK])}


def run(contexts=(300, 2000), rounds: int = 10, log=print) -> dict[tuple[int, str], tuple[float, float]]:
    """{(context, variant): (min, median) ms per token over `rounds` alternated rounds}."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, DIM, generator=gen).to(torch.bfloat16)
    results = {}
    for context in contexts:
        table = torch.arange(FIRST_BLOCK, FIRST_BLOCK + -(-context // BLOCK), dtype=torch.int32).unsqueeze(0)
        cases = variants(context, gen)
        times = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (cache, first) in cases.items():
                started = time.perf_counter()
                for layer in range(LAYERS):
                    paged_attention_torch(q, cache[0, layer], cache[1, layer], table, [1], [context], DIM ** -0.5,
                                          first)
                times[name].append((time.perf_counter() - started) * 1e3)
        for name, t in times.items():
            t.sort()
            results[(context, name)] = (t[0], t[len(t) // 2])
            log(f"context {context:5d}  {name:24s} min {t[0]:6.2f}  median {t[len(t) // 2]:6.2f} ms per token")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", nargs="+", type=int, default=[300, 2000])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    run(args.context, args.rounds)


if __name__ == "__main__":
    main()
