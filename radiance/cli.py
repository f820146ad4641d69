"""`radiance` command line: a thin dispatcher.

Each area registers its own subcommands from its package (`register(subparsers)` in
`radiance.<area>.cli`), so the parsers live next to the code they drive. Errors that are the
user's (bad path, broken checkpoint, bad option) print one line and exit 2 without a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import io
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


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too: they take the class of their parent), but a mistake is answered
    with a short usage line and the error: argparse printed the whole usage first, 50 lines for `serve`, which
    pushed the one line that says what is wrong out of sight."""

    def error(self, message: str):
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n")

    def short_usage(self) -> str:
        formatter = self._get_formatter()
        words = [self.prog, "[options]"]
        for action in self._get_positional_actions():
            metavar = formatter._get_default_metavar_for_positional(action)
            words.append(formatter._format_args(action, metavar))
        return f"usage: {' '.join(words)}  ('{self.prog} --help' explains each option)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="radiance",
        description="Serve 4-bit MXFP4 / NVFP4 LLM checkpoints on GPUs without FP4 tensor cores "
                    "(and on the CPU through reference kernels).",
    )
    parser.add_argument("--version", action="version", version=f"radiance {__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        importlib.import_module(name).register(sub)
    for subparser in _subparsers(parser):
        _add_global_options(subparser, top=False)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """The options of every command, taken before the command or after it (`radiance generate ... --log-level
    DEBUG`). Below the top their default is SUPPRESS, so an option not given there keeps the top's value."""
    # any case, as RADIANCE_LOG_LEVEL and uvicorn's --log-level take it (`--log-level debug`)
    parser.add_argument("--log-level", type=str.upper, default=log_level() if top else argparse.SUPPRESS,
                        choices=LOG_LEVELS,
                        help="level of the log lines on stderr (default: $RADIANCE_LOG_LEVEL or INFO)")
    parser.add_argument("--no-progress", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="no progress bars on stderr (loading, downloading, converting, eval, bench serve)")


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser below `parser` (commands and their subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield subparser
                yield from _subparsers(subparser)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is refused by the command it was given to, with the usage of that command
    and the option it most likely meant: argparse's top parser answered `radiance generate hi --temprature 0.5`
    with radiance's own usage and "radiance: error: unrecognized arguments"."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = _command_parser(parser, args)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command, unknown)}")
    return args


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the words typed ("bench serve"), or the top one before any command."""
    for word in _command_path(args).split() if getattr(args, "command", None) else ():
        parser = next(action.choices[word] for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction))
    return parser


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """" (did you mean --temperature?)" for the first unknown option close to one the command takes."""
    options = [name for action in parser._actions for name in action.option_strings]
    for word in unknown:
        if word.startswith("--") and word.split("=", 1)[0] not in options:  # one it takes came after "--"
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.log_level not in LOG_LEVELS:  # argparse checks the flag, not a default from the environment
        print(f"radiance: error: RADIANCE_LOG_LEVEL={args.log_level} is not one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    if args.no_progress:  # the Hub's download bars; radiance's own bars take the flag from args
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _escape_what_stdout_cannot_encode()
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except BrokenPipeError:  # the reader went away (`radiance generate ... | head -1`): no traceback
        _silence_stdout()
        return 141  # 128 + SIGPIPE: what a tool killed by the signal reports to the shell
    # radiance's own errors, and the ValueErrors libraries raise over the user's input (a tokenizer's chat template)
    except (RadianceError, ValueError) as exc:
        logging.getLogger("radiance").debug("error details", exc_info=True)
        print(f"radiance {_command_path(args)}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _escape_what_stdout_cannot_encode() -> None:
    """Output in an encoding without the model's characters (a Windows pipe's cp1252, PYTHONIOENCODING=ascii) gets
    them as \\u escapes, as stderr writes them: it was an error after generating, and the answer was lost."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


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
