"""`radiance` command line: a thin dispatcher.

Each area registers its own subcommands from its package (`register(subparsers)` in
`radiance.<area>.cli`), so the parsers live next to the code they drive. Errors that are the
user's (bad path, broken checkpoint, bad option) print one line and exit 2 without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from radiance import __version__
from radiance.env import log_level
from radiance.errors import RadianceError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# (module, subcommands it registers) in the order --help lists them
_AREAS = (
    "radiance.server.cli",      # serve
    "radiance.engine.cli",      # generate
    "radiance.checkpoint.cli",  # convert, inspect
    "radiance.bench.cli",       # bench, eval
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radiance",
        description="Serve 4-bit MXFP4 / NVFP4 LLM checkpoints on GPUs without FP4 tensor cores "
                    "(and on the CPU through reference kernels).",
    )
    parser.add_argument("--version", action="version", version=f"radiance {__version__}")
    parser.add_argument("--log-level", default=log_level(), choices=LOG_LEVELS,
                        help="level of the log lines on stderr (default: $RADIANCE_LOG_LEVEL or INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # argparse checks the flag, not a default from the environment
        print(f"radiance: error: RADIANCE_LOG_LEVEL={args.log_level} is not one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except BrokenPipeError:  # the reader went away (`radiance generate ... | head -1`): no traceback
        _silence_stdout()
        return 141  # 128 + SIGPIPE: what a tool killed by the signal reports to the shell
    except (RadianceError, ValueError) as exc:  # config / sampling validation: the user's to fix
        logging.getLogger("radiance").debug("error details", exc_info=True)
        print(f"radiance {_command_path(args)}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(message: str) -> str:
    """A library's multi-line message (transformers' tokenizer errors) as one line: the CLI's errors are one each."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _command_path(args: argparse.Namespace) -> str:
    """The words typed ("bench serve", not "bench"), as argparse's own errors name the command."""
    sub = getattr(args, f"{args.command}_command", None)  # bench_command, eval_command: the areas' subparsers
    return f"{args.command} {sub}" if sub else args.command


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so Python's flush at exit does not raise on the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
