"""Requests that arrive while others decode, on a synthetic model in the engine: wall time and output tok/s
with the piecewise CUDA graphs on and off (the same engine, alternated), and which path served the steps.
The measurement behind bench/RESULTS.md's twenty-sixth session.

    python3 tools/arrivals_bench.py --model synthetic:qwen3-30b-a3b --quantization mxfp4 \
        --requests 32 --prompt-len 256 --output-len 64 --gap 2 [--repeats 2]

Request i arrives once the engine has taken gap * i steps, so most steps prefill a prompt (or a chunk of it)
next to the running decodes: the steps no whole-step graph serves. "eager" hides the piecewise graphs from
the runner (the decode and single-sequence prefill graphs stay). CUDA only.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import torch

from radiance.bench.engine_bench import _engine, _random_ids
from radiance.engine.sampling_params import SamplingParams


def staggered_run(engine, prompts: list[list[int]], output_len: int, gap: int, tag: str) -> tuple[float, int, int]:
    """(wall seconds, output tokens, engine steps) of the prompts arriving every `gap` steps."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    arrived = steps = produced = 0
    while arrived < len(prompts) or engine.has_unfinished_requests():
        if arrived < len(prompts) and steps >= gap * arrived:
            engine.add_request(f"{tag}-{arrived}", prompts[arrived], params)
            arrived += 1
        steps += 1
        produced += sum(1 for out in engine.step() if out.token_ids)
    torch.cuda.synchronize()
    return time.perf_counter() - start, produced, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:qwen3-30b-a3b")
    parser.add_argument("--quantization", nargs="+", default=["mxfp4"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--gap", type=int, default=2, help="engine steps between two arrivals")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per variant, after one warm-up each")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("radiance.engine.model_runner").setLevel(logging.INFO)  # the graphs' capture times
    gen = torch.Generator().manual_seed(0)
    print("| model | quantization | variant | run | wall s | output tok/s | steps | piecewise replays |")
    print("|---|---|---|---|---|---|---|---|")
    for quant in args.quantization:
        for row in measure(args, quant, gen):
            print(row, flush=True)
        gc.collect()  # the engine goes before the next quantization's is built
        torch.cuda.empty_cache()


def measure(args, quant: str, gen: torch.Generator) -> list[str]:
    engine = _engine(args.model, quant, args.prompt_len + args.output_len + 64, "cuda", None,
                     max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.85)
    runner = engine.runner
    pieces, replays = runner.piecewise, [0]
    replay = pieces.replay

    def counted(*step_args):
        replays[0] += 1
        return replay(*step_args)

    pieces.replay = counted
    vocab, rows = engine.model.config.vocab_size, []
    for run in range(args.repeats + 1):  # run 0 warms up (Triton compiles the eager path's shapes)
        for variant in ("piecewise", "eager"):
            runner.piecewise = pieces if variant == "piecewise" else None
            prompts = [_random_ids(args.prompt_len, vocab, gen) for _ in range(args.requests)]
            replays[0] = 0
            wall, produced, steps = staggered_run(engine, prompts, args.output_len, args.gap, f"{variant}{run}")
            if run:
                rows.append(f"| {args.model} | {quant} | {variant} | {run} | {wall:.2f} | {produced / wall:,.0f} | "
                            f"{steps} | {replays[0]} |")
    return rows


if __name__ == "__main__":
    main()
