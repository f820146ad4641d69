"""`radiance ... --help` prints for every subcommand, and each config-driven flag states its default in words."""

import argparse
import dataclasses

import pytest

from radiance.cli import build_parser, main
from radiance.config_cli import add_dataclass_args


def _parsers(parser: argparse.ArgumentParser, path: str = "radiance"):
    """(command path, parser) of the top level and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


@pytest.mark.parametrize("path, parser", list(_parsers(build_parser())), ids=lambda v: v if isinstance(v, str) else "")
def test_every_help_page_formats(path, parser):
    """argparse %-formats help strings: one "%" in a config comment made `generate --help` a traceback."""
    text = parser.format_help()
    assert "usage:" in text and "(default: None)" not in text, path


@pytest.mark.parametrize("command", [["generate"], ["serve"]])
def test_help_of_the_engine_commands_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "bfloat16 is up to ~20% faster on some x86 CPUs" in out  # the comment's percent sign, printed as one
    assert "--max-model-len MAX_MODEL_LEN tokens of a sequence (prompt and output) at most" in out


def test_an_unset_default_is_explained_not_printed_as_none():
    @dataclasses.dataclass(frozen=True)
    class Example:
        explained: int | None = None  # a count; default: as many as fit
        unexplained: str | None = None  # a name
        names: tuple[str, ...] = ()  # aliases
        share: float = 0.5  # 50% of it

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Example, group=False)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["explained"] == "a count; default: as many as fit"
    assert helps["unexplained"] == "a name (default: none)"
    assert helps["names"] == "aliases (default: none)"
    assert helps["share"] == "50%% of it (default: 0.5)"  # argparse prints %% as %
    assert "50% of it" in parser.format_help()


def _options_with_silent_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Options whose default matters (not unset, empty or a --no-X switch) but whose help does not state it."""
    silent = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                                            argparse._StoreFalseAction)):  # --no-X says it all
            continue
        unset = action.default in (None, False, argparse.SUPPRESS) or action.default in ((), [])
        if unset or action.help in (None, argparse.SUPPRESS):
            continue
        if "default" not in action.help:
            silent.append(action.option_strings[-1])
    return silent


@pytest.mark.parametrize("path, parser", list(_parsers(build_parser())), ids=lambda v: v if isinstance(v, str) else "")
def test_every_option_with_a_default_states_it(path, parser):
    """`eval --quantization` (none for ppl, mxfp4 for kl) and `bench serve --concurrency` said nothing of theirs."""
    assert _options_with_silent_defaults(parser) == [], path
