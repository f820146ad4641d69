"""Wall ms of each engine step for prompt shapes, eager against piecewise CUDA graphs, on a synthetic model: the
measurement behind bench/RESULTS.md's sixty-ninth session (Qwen3.5-9B's steps with and without piecewise graphs).

    python3 tools/prefill_steps.py --model synthetic:qwen3.5-9b --quantization mxfp4 \
        --variants eager piecewise --shapes 1024 1024 2048 4x256 same1024x3 8192

A shape is N (one new prompt of N tokens), KxN (K new prompts of N tokens in one step), or sameNxR (one prompt of N
tokens sent R times: after the first, prefix hits). Each variant builds its own engine ("eager": no piecewise
graphs; "piecewise": the model's default buckets; "piecewise:4096": buckets up to 4096 tokens) and runs a
512-token prompt first (compiles); each step is timed between two syncs, one max_tokens=1 request at a time. CUDA
(`run(..., device="cpu")` is the tests' dry run).
"""

from __future__ import annotations

import argparse
import gc
import logging
import re
import time

import torch

from radiance.bench.engine_bench import _engine, _random_ids
from radiance.config import PIECEWISE_DENSE_TOKENS, PIECEWISE_MOE_TOKENS
from radiance.engine.sampling_params import SamplingParams

_SHAPE = re.compile(r"^(?:(\d+)x)?(\d+)$|^same(\d+)x(\d+)$")


def variant_options(variant: str) -> dict:
    """EngineConfig options of a variant: eager, piecewise, or piecewise:MAX (the default buckets up to MAX)."""
    if variant == "eager":
        return {"piecewise_graph_tokens": (0,)}
    if variant == "piecewise":
        return {}
    if variant.startswith("piecewise:") and variant[10:].isdigit():
        top = int(variant[10:])
        return {"piecewise_graph_tokens": tuple(t for t in PIECEWISE_MOE_TOKENS if t <= top) or PIECEWISE_DENSE_TOKENS}
    raise argparse.ArgumentTypeError(f"variant {variant!r}: eager, piecewise or piecewise:MAX")


def shape_requests(shape: str) -> list[tuple[int, int]]:
    """[(prompts in one step, tokens each), ...] to run in turn: '1024' -> [(1, 1024)], '4x256' -> [(4, 256)],
    'same1024x3' -> three runs of one shared 1024-token prompt (marked by a count of -1)."""
    match = _SHAPE.match(shape)
    if not match or "0" in (match.group(1), match.group(4)) or int(match.group(2) or match.group(3)) < 1:
        raise argparse.ArgumentTypeError(f"shape {shape!r}: N, KxN or sameNxR (positive counts)")
    count, tokens, same, repeats = match.groups()
    if same:
        return [(-1, int(same))] * int(repeats)
    return [(int(count or 1), int(tokens))]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_times(engine, prompts: list[list[int]], device: str = "cuda") -> list[float]:
    """Wall ms of each engine step until the prompts (one output token each) finish."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", ids, params)
    times = []
    while engine.has_unfinished_requests():
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run(model: str, quantization: str, variants: list[str], shapes: list[str], max_num_seqs: int = 16,
        device: str = "cuda", overrides: dict | None = None, warm_up: int = 512, log=print) -> dict:
    """{(variant, shape): [the step times of each of its runs]}; `device="cpu"` with a small `overrides` config is
    a dry run of the harness (no graphs there, no timings that matter)."""
    runs = {shape: shape_requests(shape) for shape in shapes}
    longest = max(tokens * max(count, 1) for requests in runs.values() for count, tokens in requests)
    budget = max(longest, warm_up)
    results = {}
    for variant in variants:
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        engine = _engine(model, quantization, budget + 256, device, overrides, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs, gpu_memory_utilization=0.85, **variant_options(variant))
        vocab = engine.model.config.vocab_size
        pieces = engine.runner.piecewise
        log(f"{variant}: engine built in {time.perf_counter() - start:.1f} s, piecewise buckets "
            f"{pieces.sizes if pieces else None}")
        step_times(engine, [_random_ids(warm_up, vocab, gen)], device)
        for shape, requests in runs.items():
            shared, results[variant, shape] = None, []
            for count, tokens in requests:
                if count < 0:
                    shared = shared or _random_ids(tokens, vocab, gen)
                    prompts = [shared]
                else:
                    prompts = [_random_ids(tokens, vocab, gen) for _ in range(count)]
                times = step_times(engine, prompts, device)
                results[variant, shape].append(times)
                log(f"{variant:>16s} {shape:>12s}: " + " ".join(f"{t:7.1f}" for t in times))
        del engine, pieces
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _checked(parse):
    def check(text: str) -> str:
        parse(text)
        return text
    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic:qwen3.5-9b")
    parser.add_argument("--quantization", default="mxfp4")
    parser.add_argument("--variants", nargs="+", type=_checked(variant_options), default=["eager", "piecewise"])
    parser.add_argument("--shapes", nargs="+", type=_checked(shape_requests),
                        default=["1024", "1024", "4x256", "same1024x3", "8192"])
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run(args.model, args.quantization, args.variants, args.shapes, args.max_num_seqs)


if __name__ == "__main__":
    main()
