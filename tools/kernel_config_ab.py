"""A KernelConfig field A/B inside one engine: the decode step time with every MXFP4 linear's field set to
each value in turn (CUDA graphs re-captured per value), alternated, and whether greedy tokens stay the same.

    python3 tools/kernel_config_ab.py --field defer_split_sum --values false true [--model synthetic:qwen3-32b] \
        [--batches 1 8 64] [--only o_proj down_proj]

`--only` sets the field on the linears whose names end with one of the given suffixes (the rest keep the
default), e.g. to see which projection a change helps. Prefix caching is off, so the token check compares
the same prefills. On the CPU (`--device cpu`) it is a dry run of the harness: timings meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import decode_ablation  # tools/, next to this script
from radiance.bench.engine_bench import _engine, _random_ids
from radiance.config import KernelConfig
from radiance.engine.sampling_params import SamplingParams
from radiance.layers.linear import Mxfp4Linear


def parse_value(field: str, text: str):
    """A command-line value as the type of KernelConfig's default for `field`."""
    if field not in KernelConfig.__dataclass_fields__:
        raise ValueError(f"{field!r} is not a KernelConfig field")
    kind = type(getattr(KernelConfig(), field))
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field} takes true or false, not {text!r}")
        return text.lower() in ("true", "1")
    return kind(text)


def set_field(engine, field: str, value, only: tuple[str, ...] = ()) -> None:
    """Every (or every `only`-suffixed) MXFP4 linear of the engine's model gets `field` = `value`; the
    decode graphs are re-captured."""
    for name, module in engine.model.named_modules():
        if isinstance(module, Mxfp4Linear) and (not only or name.endswith(only)):
            module.kernel_config = dataclasses.replace(module.kernel_config, **{field: value})
    decode_ablation.recapture(engine)


def greedy_tokens(engine, prompts: list[list[int]], tokens: int = 24) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"ab{i}", ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finish_reason is not None:
                out[o.request_id] = list(o.token_ids)
    return out


def run(model: str, field: str, values: list, batches: list[int], only: tuple[str, ...] = (), device: str = "cuda",
        repeats: int = 2, steps: int = 24, overrides: dict | None = None, log=print) -> dict:
    """{"tokens_equal": bool, "ms": {value: [[ms per batch] per repeat]}}; `overrides`: model config fields
    (a small model for a dry run)."""
    engine = _engine(model, "mxfp4", 4096, device, overrides, max_num_batched_tokens=8192,
                     max_num_seqs=max(8, *batches), gpu_memory_utilization=0.6, prefill_graph_tokens=(),
                     enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model.config.vocab_size
    prompts = [_random_ids(100 + 7 * i, vocab, gen) for i in range(3)]
    seen = []
    for value in values:
        set_field(engine, field, value, only)
        seen.append(greedy_tokens(engine, prompts))
    result = {"tokens_equal": all(s == seen[0] for s in seen), "ms": {}}
    log(f"greedy tokens equal across {field} values: {result['tokens_equal']}")
    gen = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        for value in values:
            set_field(engine, field, value, only)
            ms = [min(decode_ablation.step_ms(engine, b, gen, steps=steps) for _ in range(2)) for b in batches]
            result["ms"].setdefault(value, []).append(ms)
            log(f"{field}={value}: " + ", ".join(f"batch {b} {t:.3f} ms" for b, t in zip(batches, ms)))
    set_field(engine, field, getattr(KernelConfig(), field), only)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--field", required=True, help="a KernelConfig field, e.g. defer_split_sum")
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--only", nargs="*", default=[], help="linear-name suffixes to change (default: all)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    values = [parse_value(args.field, v) for v in args.values]
    result = run(args.model, args.field, values, args.batches, tuple(args.only), args.device)
    print(f"| {args.field} | " + " | ".join(f"batch {b} ms" for b in args.batches) + " |")
    for value, reps in result["ms"].items():
        print(f"| {value} | " + " | ".join(" / ".join(f"{r[i]:.3f}" for r in reps) for i in range(len(args.batches)))
              + " |")


if __name__ == "__main__":
    main()
