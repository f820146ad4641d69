"""Single-sequence prefill wall times of a synthetic model in the engine, repeated, for each quantization: the
measurement behind bench/RESULTS.md's twenty-fifth session (engine_bench's one best-of-3 cell per length hides
spreads; this prints every run).

    python3 tools/prefill_reps.py --model synthetic:qwen3-30b-a3b --quantization none mxfp4 \
        --lengths 1024 2048 4096 8192 [--repeats 4] [--eager-ab]

`--eager-ab` alternates each length between the engine's prefill graphs and eager steps (the graph buckets
hidden from the runner), to see what the graphs buy. Each engine is built once per quantization with the
default options (prefill graph buckets by model kind, RunnerConfig.prefill_graph_buckets). CUDA only.
"""

from __future__ import annotations

import argparse
import time

import torch

from radiance.bench.engine_bench import _engine, _random_ids
from radiance.engine.sampling_params import SamplingParams


def prefill_ms(engine, length: int, gen: torch.Generator, tag: str) -> float:
    """Wall ms of one request's prefill (one token sampled), synchronized on both ends."""
    vocab = engine.model.config.vocab_size
    engine.add_request(tag, _random_ids(length, vocab, gen), SamplingParams(max_tokens=1, temperature=0.0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:qwen3-30b-a3b")
    parser.add_argument("--quantization", nargs="+", default=["none", "mxfp4"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=4, help="timed runs per length, after one warm-up")
    parser.add_argument("--eager-ab", action="store_true", help="alternate graph-replayed and eager prefills")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for quant in args.quantization:
        engine = _engine(args.model, quant, max(args.lengths) + 256, "cuda", None,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=64,
                         gpu_memory_utilization=0.85)
        runner = engine.runner
        graphs = runner.prefill_graphs
        buckets = list(graphs.sizes)
        for length in args.lengths:
            # eager: only the buckets below this length stay visible ([0] when none: the runner reads the last)
            modes = ({"graph": buckets, "eager": [s for s in buckets if s < length] or [0]} if args.eager_ab
                     else {"default": buckets})
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for rep in range(args.repeats + 1):
                for mode, sizes in modes.items():
                    graphs.sizes = sizes
                    ms = prefill_ms(engine, length, gen, f"{quant}-{mode}-{length}-{rep}")
                    if rep:  # the first run warms up
                        times[mode].append(ms)
            graphs.sizes = buckets
            for mode, ms in times.items():
                rows.append(f"| {quant} | {mode} | {length} | {' / '.join(f'{t:.1f}' for t in ms)} | "
                            f"{length / min(ms) * 1e3:,.0f} |")
                print(rows[-1], flush=True)
        del engine, runner, graphs
        torch.cuda.empty_cache()
    print(f"\n{args.model}, prefill graph buckets by model kind\n")
    print("| quantization | prefill | tokens | wall ms per run | best tok/s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
