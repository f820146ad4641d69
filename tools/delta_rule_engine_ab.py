"""Prefill tok/s of a hybrid model on the engine with each chunked delta-rule form, alternated in one engine: what a
form that wins tools/gated_delta_prefill_sweep.py by launch is worth to a whole prefill step.

    python3 tools/delta_rule_engine_ab.py [--model synthetic:qwen3.5-9b] [--quantization mxfp4]
        [--lengths 1024 8192] [--rounds 2] --forms 32:64/tf32x3:tf32x3/4:8/blocks 32:64/tf32x3/4:8/doubling

A form is the sweep's spec (BLOCK_V[:OUT]/PRECISION[:OUT]/WARPS[:SCAN[:OUT]]/INVERSE[/SCAN_STAGES]), or "served"
(chunked_prefill's defaults). The forms take turns, `--rounds` times, each timing every length (best of three
prompts after a warm-up: engine_bench's prefill measure). CUDA only: the CPU runs torch's chunked form, never these
kernels.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gated_delta_prefill_sweep import parse_chunked  # noqa: E402

import radiance.models.qwen3_5 as qwen3_5  # noqa: E402
from radiance.bench import engine_bench  # noqa: E402
from radiance.kernels._triton.gated_delta_chunked import chunked_prefill  # noqa: E402


def parse_form(text: str) -> tuple[str, dict]:
    """A form's label and chunked_prefill keyword arguments ("served": none)."""
    return (text, {}) if text == "served" else (text, parse_chunked(text))


def serve_form(kwargs: dict) -> None:
    """The hybrid layers' prefill delta rule runs chunked_prefill with these arguments from now on."""
    qwen3_5.chunked_prefill = functools.partial(chunked_prefill, **kwargs)


def table(rows: dict, labels: list[str], lengths: list[int]) -> str:
    lines = ["| form | " + " | ".join(f"prefill tok/s @{n}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for label in labels:
        cells = (" / ".join(f"{tok_s:,.0f}" for tok_s in rows[(label, n)]) for n in lengths)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:qwen3.5-9b")
    parser.add_argument("--quantization", default="mxfp4")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--forms", type=parse_form, nargs="+", required=True, metavar="FORM")
    args = parser.parse_args()
    top = max(args.lengths)
    with torch.inference_mode():
        engine = engine_bench._engine(args.model, args.quantization, top + 64, "cuda", None,
                                      max_num_batched_tokens=top, max_num_seqs=16, gpu_memory_utilization=0.85)
        gen = torch.Generator().manual_seed(0)
        rows: dict = {}
        for _ in range(args.rounds):
            for label, kwargs in args.forms:
                serve_form(kwargs)
                for n in args.lengths:
                    tok_s = engine_bench._prefill_tok_s(engine, n, gen)
                    rows.setdefault((label, n), []).append(tok_s)
                    print(f"{label} @{n}: {tok_s:,.0f} tok/s", flush=True)
    print(table(rows, [label for label, _ in args.forms], args.lengths))


if __name__ == "__main__":
    main()
