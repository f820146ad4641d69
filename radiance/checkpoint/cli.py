"""`radiance convert` and `radiance inspect`.

    radiance convert SRC DST --format mxfp4 [--rule mse|noclip|ocp] [--ignore REGEX ...]
    radiance inspect [PATH]            (no PATH: the embedded SmolLM2)

SRC may be `embedded` for the built-in SmolLM2 GGUF.
"""

from __future__ import annotations

import argparse
import errno
import os
import tempfile

from radiance.checkpoint import EMBEDDED
from radiance.config import ConvertConfig
from radiance.config_cli import add_dataclass_args, config_from_args
from radiance.errors import ConfigError


def _not_empty(value: str, name: str, wanted: str) -> None:
    """An empty argument ("" from an unset shell variable) said so: as a path it named no file, or the current
    directory."""
    if not value.strip():
        raise ConfigError(f"{name} is empty: give {wanted}")


def _run_convert(args: argparse.Namespace) -> int:
    from radiance.checkpoint.writer import convert_checkpoint

    _not_empty(args.src, "SRC", f"an HF model directory, a .gguf file, or '{EMBEDDED}'")
    _not_empty(args.dst, "DST", "the directory to write the converted checkpoint to")
    config = config_from_args(args, ConvertConfig)
    _check_mxfp4_options(config)
    _check_destination(args.dst)
    report = convert_checkpoint(args.src, args.dst, config, progress=not args.no_progress)
    print(report.summary())  # the result on stdout; the log lines (stderr) say what was read and written
    return 0


def _check_mxfp4_options(config: ConvertConfig) -> None:
    """--rule and --chunk-rows steer the conversion to MXFP4 only: with another format they did nothing, silently."""
    if config.format == "mxfp4":
        return
    if config.rule != ConvertConfig.rule:
        raise ConfigError(f"--rule {config.rule} picks MXFP4 block exponents; --format {config.format} has none "
                          "(leave --rule out, or convert to mxfp4)")
    if config.chunk_rows is not None:
        raise ConfigError(f"--chunk-rows bounds the memory of the conversion to mxfp4 only, not to --format "
                          f"{config.format} (leave it out)")


def _check_destination(dst: str) -> None:
    """DST can take the checkpoint: checked before SRC is opened, since a Hub id is downloaded first (gigabytes) and
    the writer refused a DST it cannot use only after that."""
    path = os.path.abspath(dst)
    if os.path.exists(path):
        if not os.path.isdir(path) or _entries(path):
            raise ConfigError(f"DST {dst} exists and is not an empty directory: give a new or empty one")
        writable = path
    else:
        writable = _nearest_existing(path)
        if not os.path.isdir(writable):
            raise ConfigError(f"DST {dst}: {writable} is not a directory, so nothing can be written below it")
    _probe_writable(writable, dst)


def _probe_writable(directory: str, dst: str) -> None:
    """A directory made and removed in `directory`: a read-only mount or /proc fails it even for root, whom
    os.access lets through."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".radiance-probe-", dir=directory))
    except OSError as exc:
        # /proc says "No such file or directory" of the directory it holds: the errno's words only where they say why
        why = f" ({exc.strerror})" if exc.errno in _TELLING_ERRNOS else ""
        raise ConfigError(f"DST {dst}: cannot create a directory in {directory}{why}: give a directory you can "
                          "write to") from None


_TELLING_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError as exc:  # no permission to read it: it cannot be checked empty, nor written
        raise ConfigError(f"DST {path}: cannot read it: {exc.strerror}") from None


def _nearest_existing(path: str) -> str:
    """The deepest existing directory (or file) above `path`: where writing `path` creates its first directory."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _run_inspect(args: argparse.Namespace) -> int:
    from radiance.checkpoint import open_checkpoint
    from radiance.checkpoint.inspect import inspect_report

    ckpt = open_checkpoint(args.path)
    lines, warnings = inspect_report(ckpt, with_tokenizer=args.tokenizer, with_values=args.values,
                                     progress=not args.no_progress)
    print("\n".join(lines))
    return 1 if (args.strict and warnings) else 0


def register(subparsers) -> None:
    convert = subparsers.add_parser(
        "convert", help="write a checkpoint as MXFP4 / NVFP4 / FP8 (compressed-tensors layout)",
        description="Convert a model (HF directory, GGUF file, or 'embedded') to a compressed-tensors "
                    "checkpoint. lm_head and embeddings stay 16-bit unless --quantize-lm-head.")
    convert.add_argument("src", help="HF model directory, .gguf file, Hugging Face Hub id (org/name[:TAG]), or "
                                     "'embedded' for the built-in SmolLM2")
    convert.add_argument("dst", help="output directory (must not exist or be empty)")
    add_dataclass_args(convert, ConvertConfig, group="conversion options")
    convert.set_defaults(func=_run_convert)

    inspect = subparsers.add_parser(
        "inspect", help="print a checkpoint's layers, formats, shapes, bytes and sanity warnings",
        description="Describe a checkpoint from its headers (no tensor data is read unless --values).")
    inspect.add_argument("path", nargs="?", default=None,
                         help="HF directory, .gguf file or Hugging Face Hub id (default: the embedded SmolLM2)")
    inspect.add_argument("--tokenizer", action="store_true", help="also load the tokenizer and report it")
    inspect.add_argument("--values", action="store_true",
                         help="also read every weight and list each one holding NaN or inf values, or a scale a load "
                              "refuses (reads the whole checkpoint, as a load does)")
    inspect.add_argument("--strict", action="store_true",
                         help="exit 1 when there are sanity warnings (a model radiance cannot serve included)")
    inspect.set_defaults(func=_run_inspect)
