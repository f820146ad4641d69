"""The `radiance` dispatcher and `radiance generate`: the user's mistakes are one line, found before a model loads."""

import subprocess
import sys

import pytest

from radiance.cli import main


def _one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(prefix), err
    return err


def test_a_bad_log_level_from_the_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RADIANCE_LOG_LEVEL", "chatty")
    assert main(["inspect"]) == 2
    assert "RADIANCE_LOG_LEVEL=CHATTY is not one of DEBUG, INFO, WARNING, ERROR" in _one_error_line(capsys, "radiance:")


def test_the_log_level_flag_overrides_a_bad_environment(monkeypatch, capsys, tmp_path):
    """--version exits before the log level is read: a command that gets past it (to a missing path) shows the
    flag wins, where the same command without it stops at the environment's value."""
    monkeypatch.setenv("RADIANCE_LOG_LEVEL", "chatty")
    missing = str(tmp_path / "nope")
    assert main(["--log-level", "ERROR", "inspect", missing]) == 2
    err = capsys.readouterr().err
    assert "RADIANCE_LOG_LEVEL" not in err and "nope" in err
    assert main(["inspect", missing]) == 2
    assert "RADIANCE_LOG_LEVEL=CHATTY" in capsys.readouterr().err


@pytest.fixture
def no_loading(monkeypatch):
    from radiance.engine.llm import LLM

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded although an option was bad")

    monkeypatch.setattr(LLM, "from_engine_config", must_not_load)


@pytest.mark.parametrize("argv, message", [
    # each names the flag typed, not the field behind it ("max_tokens must be at least 1" before)
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
    (["--temperature", "-1"], "--temperature must be in [0, 2], got -1"),
    (["--temperature", "nan"], "--temperature must be a number, got nan"),  # was "must be non-negative, got nan"
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--frequency-penalty", "3"], "--frequency-penalty must be in [-2, 2]"),
    (["--grammar", "/nonexistent.gbnf"], "--grammar: cannot read /nonexistent.gbnf"),
    (["--min-tokens", "65"], "--min-tokens must be at most --max-tokens, got --min-tokens 65 > --max-tokens 64"),
    (["--quantization", "mxfp5"], "--quantization must be one of ('auto', 'mxfp4', 'nvfp4', 'none'), got 'mxfp5'"),
    (["--max-model-len", "0"], "--max-model-len must be positive, got 0"),
    (["--quantize-lm-head"], "--quantize-lm-head needs --quantization mxfp4 or nvfp4"),
])
def test_generate_checks_its_options_before_loading(no_loading, capsys, argv, message):
    assert main(["generate", "hi", *argv]) == 2
    assert message in _one_error_line(capsys, "radiance generate: error:")


@pytest.mark.parametrize("argv, level, no_progress", [
    (["generate", "x", "--log-level", "DEBUG", "--no-progress"], "DEBUG", True),
    (["--log-level", "ERROR", "generate", "x"], "ERROR", False),  # a subcommand's unset option keeps the top's
    (["--no-progress", "--log-level", "ERROR", "generate", "x", "--log-level", "WARNING"], "WARNING", True),
    (["bench", "serve", "--url", "http://h", "--log-level", "ERROR"], "ERROR", False),
    (["bench", "--no-progress", "serve", "--url", "http://h"], "INFO", True),
    (["eval", "kl", "--text", "t.txt", "--no-progress"], "INFO", True),
    (["convert", "a", "b", "--no-progress", "--log-level", "DEBUG"], "DEBUG", True),
    (["serve", "--log-level", "WARNING"], "WARNING", False),
])
def test_global_options_are_taken_before_or_after_the_command(monkeypatch, argv, level, no_progress):
    from radiance.cli import build_parser

    monkeypatch.delenv("RADIANCE_LOG_LEVEL", raising=False)
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.no_progress) == (level, no_progress)


@pytest.mark.parametrize("flags, bar", [([], True), (["--no-progress"], False)])
def test_generate_draws_the_loading_bar_unless_told_not_to(capsys, flags, bar):
    assert main(["--log-level", "ERROR", "generate", "hi", "--max-tokens", "1", "--device", "cpu", *flags]) == 0
    err = capsys.readouterr().err
    assert ("tensor/s" in err) == bar, err[-500:]


def test_python_dash_m_radiance_is_the_radiance_command():
    done = subprocess.run([sys.executable, "-m", "radiance", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: radiance ")
