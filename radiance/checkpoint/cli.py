"""`radiance convert` and `radiance inspect`.

    radiance convert SRC DST --format mxfp4 [--rule mse|noclip|ocp] [--ignore REGEX ...]
    radiance inspect [PATH]            (no PATH: the embedded SmolLM2)

SRC may be `embedded` for the built-in SmolLM2 GGUF.
"""

from __future__ import annotations

import argparse

from radiance.config import ConvertConfig, add_dataclass_args, dataclass_kwargs
from radiance.errors import ConfigError

EMBEDDED = "embedded"


def _source(path: str | None) -> str | None:
    return None if path in (None, EMBEDDED) else path


def _run_convert(args: argparse.Namespace) -> int:
    from radiance.checkpoint.writer import convert_checkpoint

    try:
        config = ConvertConfig(**dataclass_kwargs(args, ConvertConfig))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = convert_checkpoint(_source(args.src), args.dst, config, progress=not args.no_progress)
    print(report.summary())
    print(f"wrote {args.dst}")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from radiance.checkpoint import open_checkpoint
    from radiance.checkpoint.inspect import inspect_report

    ckpt = open_checkpoint(_source(args.path))
    lines, warnings = inspect_report(ckpt, with_tokenizer=args.tokenizer)
    print("\n".join(lines))
    return 1 if (args.strict and warnings) else 0


def register(subparsers) -> None:
    convert = subparsers.add_parser(
        "convert", help="write a checkpoint as MXFP4 / NVFP4 / FP8 (compressed-tensors layout)",
        description="Convert a model (HF directory, GGUF file, or 'embedded') to a compressed-tensors "
                    "checkpoint. lm_head and embeddings stay 16-bit unless --quantize-lm-head.")
    convert.add_argument("src", help="HF model directory, .gguf file, or 'embedded' for the built-in SmolLM2")
    convert.add_argument("dst", help="output directory (must not exist or be empty)")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dataclass_args(convert, ConvertConfig, group="conversion options")
    convert.set_defaults(func=_run_convert)

    inspect = subparsers.add_parser(
        "inspect", help="print a checkpoint's layers, formats, shapes, bytes and sanity warnings",
        description="Describe a checkpoint from its headers (no tensor data is read).")
    inspect.add_argument("path", nargs="?", default=None,
                         help="HF directory or .gguf file (default: the embedded SmolLM2)")
    inspect.add_argument("--tokenizer", action="store_true", help="also load the tokenizer and report it")
    inspect.add_argument("--strict", action="store_true",
                         help="exit 1 when there are sanity warnings (a model radiance cannot serve included)")
    inspect.set_defaults(func=_run_inspect)
