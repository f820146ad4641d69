"""The options of `radiance bench kernels` and `radiance bench engine`, kept apart from the benchmarks:
those import torch, and `radiance --help` builds every parser (a torch import costs seconds)."""

from __future__ import annotations

import argparse
import importlib
import json

# issue 3's kernel table: shapes (N x K) and token counts
KERNEL_SHAPES = ((4096, 4096), (6144, 4096), (4096, 14336), (14336, 4096), (5120, 17408), (17408, 5120),
                 (28672, 4096))
KERNEL_M = (1, 4, 16, 64, 256, 1024, 4096, 8192)


def run_later(module: str, function: str):
    """A subcommand's func that imports its module only when the subcommand runs."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)
    return run


def parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N x K such as 4096x14336, got {text!r}") from None
    if n < 1 or k < 32 or k % 32:  # MXFP4 scales blocks of 32 along K
        raise argparse.ArgumentTypeError(f"expected N >= 1 and K a positive multiple of 32, got {text!r}")
    return n, k


def _int_at_least(text: str, low: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def _gemm_config(text: str):
    from radiance.kernels.tuning import GemmConfig
    try:
        return GemmConfig(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"not a GemmConfig as JSON: {exc}") from None


def add_kernels_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=list(KERNEL_SHAPES),
                   help="N x K list (default: the issue's 7)")
    p.add_argument("--m", type=positive_int, nargs="+", default=list(KERNEL_M), help=f"token counts M (default: {' '.join(map(str, KERNEL_M))})")
    p.add_argument("--check", action="store_true", help="kernel vs exact reference, prmt vs arithmetic, PTX wgmma")
    p.add_argument("--sweep", action="store_true", help="time tile candidates and print tuning-table entries")
    p.add_argument("--requant", action="store_true", help="time NVFP4 -> MXFP4 for an 8B Llama set of linears")
    p.add_argument("--activation-error", action="store_true",
                   help="W4A8 / W4A16 / W4A4 error on real SmolLM2 activations (CPU is enough)")
    p.add_argument("--precision-probe", action="store_true", help="accuracy and speed of the big-M tilings")
    p.add_argument("--no-table", action="store_true", help="skip the speed table")
    p.add_argument("--no-reference", action="store_true", help="skip the reference-path column")
    p.add_argument("--decode-band", type=non_negative_int, default=64,
                   help="M up to this runs the split-K decode kernel, above it the prefill kernel (default: 64)")
    p.add_argument("--config", type=_gemm_config, default=None,
                   help="force one GemmConfig (JSON) for --check and the table instead of the tuning table")
    p.add_argument("--out", help="also write all lines to this file")
    return p


def add_engine_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="synthetic:llama-3.1-8b (default), synthetic:qwen3-8b, synthetic:qwen3-32b, "
                        "synthetic:gemma-3-12b, synthetic:gemma-3-27b, synthetic:qwen3.5-9b (hybrid linear "
                        "attention), synthetic:qwen3-30b-a3b, synthetic:gpt-oss-20b, synthetic:glm-4.5-air, "
                        "synthetic:qwen3-next-80b-a3b or synthetic:llama-4-scout-17b-16e (mixtures of experts)")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # the positional's older spelling
    p.add_argument("--quantization", "--variants", dest="variants", nargs="+", default=["none", "mxfp4"],
                   help="quantization options to compare side by side (none = bf16; mxfp4; nvfp4; a '+head' "
                        "suffix, e.g. mxfp4+head, quantizes the lm_head too, '+head2' as two MXFP4 terms; a "
                        "last '+fp8kv' serves with an fp8 KV cache, e.g. mxfp4+head2+fp8kv; default: none mxfp4)")
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[128, 8192, 32768],
                   help="context depths of the batch-1 decode measurement (default: 128 8192 32768)")
    p.add_argument("--prefills", nargs="+", type=positive_int, default=[1024, 8192, 32768],
                   help="prompt lengths of the prefill measurement (default: 1024 8192 32768)")
    p.add_argument("--concurrency", nargs="+", type=positive_int, default=[1, 8, 32, 128],
                   help="concurrent sequences of the aggregate-throughput measurement (default: 1 8 32 128)")
    p.add_argument("--prefill-graphs", nargs="+", type=non_negative_int, default=None, metavar="TOKENS",
                   help="token buckets of the single-sequence prefills replayed from CUDA graphs "
                        "(RunnerConfig.prefill_graph_tokens; default 128 256 512 1024, and 1536 2048 3072 4096 for "
                        "MoE models); 0 turns them off, "
                        "for an A/B")
    p.add_argument("--no-hf", dest="with_hf", action="store_false", help="skip the HF transformers peer")
    p.add_argument("--json", help="also write the rows to this file")
    return p


def add_kernels_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "kernels", help="W4A8 GEMM vs cuBLAS bf16/fp8 and the reference (GPU)",
        description="Time radiance's W4A8 GEMM against cuBLAS bf16 / fp8 and the reference path over N x K "
                    "shapes and token counts M; --check, --sweep and the other switches add measurements. "
                    "Needs a CUDA GPU (on a CPU: --activation-error --no-table).")
    add_kernels_options(p)
    p.set_defaults(func=run_later("radiance.bench.kernels", "run_kernels_bench"))
    return p


def add_engine_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("engine", help="offline engine speed on the GPU: decode ms/step, prefill "
                                                   "tok/s, aggregate tok/s (MODEL: synthetic:llama-3.1-8b, ...)",
                                    description="Measure the offline engine on a CUDA GPU with a synthetic model "
                                                "(random weights of a real model's shapes): batch-1 decode ms/step "
                                                "at each context depth, prefill tok/s, aggregate tok/s at each "
                                                "concurrency, for each quantization side by side.")
    add_engine_options(p)
    p.set_defaults(func=run_later("radiance.bench.engine_bench", "run_args"))
    return p
