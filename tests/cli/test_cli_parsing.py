"""What argparse answers a new user's typing: a mistyped option is named by the command it was given to, with the
option meant; a mistake costs two lines, not the 50-line usage of `serve`; vLLM's and lower-case spellings are
taken; a count or time out of range is refused as the flags are read, before any import of the run."""

import argparse

import pytest

from radiance.cli import build_parser, main


def _refusal(capsys, argv) -> list[str]:
    """The stderr lines of an argparse refusal (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, error", [
    (["generate", "hi", "--temprature", "0.5"],
     "radiance generate: error: unrecognized arguments: --temprature 0.5 (did you mean --temperature?)"),
    (["bench", "serve", "--url", "http://h", "--concurency", "2"],
     "radiance bench serve: error: unrecognized arguments: --concurency 2 (did you mean --concurrency?)"),
    # 8001 is taken as serve's MODEL: only the option is left over
    (["serve", "--prot", "8001"], "radiance serve: error: unrecognized arguments: --prot (did you mean --port?)"),
    (["inspect", "a", "b"], "radiance inspect: error: unrecognized arguments: b"),  # nothing close: no guess
    # an option it takes, after "--": no "did you mean --max-tokens?"
    (["generate", "--choice", "y", "n", "--", "Wet?", "--max-tokens", "3"],
     "radiance generate: error: unrecognized arguments: --max-tokens 3"),
])
def test_an_unknown_option_is_refused_by_its_command_with_the_option_meant(capsys, argv, error):
    """Was "radiance: error: unrecognized arguments: ..." under the usage of `radiance` itself, with no hint."""
    usage, line = _refusal(capsys, argv)
    assert line == error
    assert usage.startswith(f"usage: {error.split(':')[0]} [options]")


@pytest.mark.parametrize("argv, usage", [
    (["serve", "--port", "abc"], "usage: radiance serve [options] [MODEL]"),
    (["generate"], "usage: radiance generate [options] prompt"),
    (["convert", "src"], "usage: radiance convert [options] src dst"),
    (["eval", "ppl"], "usage: radiance eval ppl [options] [model]"),
    (["bench"], "usage: radiance bench [options] WHAT ..."),
])
def test_a_mistake_is_two_lines_not_the_whole_usage(capsys, argv, usage):
    """argparse printed every option first (50 lines for serve), which pushed the error line out of sight."""
    lines = _refusal(capsys, argv)
    assert len(lines) == 2, lines
    assert lines[0].startswith(usage) and "--help' explains each option" in lines[0]
    assert lines[1].startswith(f"{usage.split()[1]} {argv[0]}") and ": error: " in lines[1]


@pytest.mark.parametrize("argv", [["--log-level", "debug", "inspect"], ["inspect", "--log-level", "Debug"]])
def test_the_log_level_takes_any_case(argv):
    """Was refused in lower case, which RADIANCE_LOG_LEVEL and uvicorn's --log-level take."""
    assert build_parser().parse_args(argv).log_level == "DEBUG"


@pytest.mark.parametrize("value, dtype", [("half", "float16"), ("float", "float32"), ("auto", None),
                                          ("bfloat16", "bfloat16"), ("float16", "float16")])
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_dtype_takes_vllms_names(command, value, dtype):
    """`vllm serve M --dtype half` runs as it is (README); was "dtype must be one of ..., got 'half'"."""
    from radiance.config_cli import engine_config_from_args

    args = build_parser().parse_args([*command, "--dtype", value])
    assert engine_config_from_args(args).model.dtype == dtype


def test_eval_dtype_takes_vllms_names_and_names_them_on_a_typo(capsys):
    assert build_parser().parse_args(["eval", "ppl", "--text", "t", "--dtype", "half"]).dtype == "float16"
    line = _refusal(capsys, ["eval", "kl", "--text", "t", "--dtype", "fp4"])[-1]
    assert "argument --dtype: expected one of float32, bfloat16, float16, half, float, auto, got 'fp4'" in line


@pytest.mark.parametrize("flags, error", [
    (["--chunks", "0"], "argument --chunks: expected a positive integer, got 0"),
    (["--chunks", "-1"], "argument --chunks: expected a positive integer, got -1"),
    (["--chunk-len", "1"], "argument --chunk-len: expected at least 2 tokens (one predicts the next), got 1"),
    (["--chunk-len", "-5"], "argument --chunk-len: expected at least 2 tokens (one predicts the next), got -5"),
    (["--chunk-len", "x"], "argument --chunk-len: expected a token count of at least 2, got 'x'"),
    (["--first-chunk", "-1"], "argument --first-chunk: expected a non-negative integer, got -1"),
])
def test_eval_refuses_counts_out_of_range_as_it_reads_them(capsys, flags, error):
    """Was "chunks must be positive and first_chunk non-negative" (both, for either) after the imports of a run."""
    assert _refusal(capsys, ["eval", "ppl", "--text", "/nonexistent.txt", *flags])[-1].endswith(error)


@pytest.mark.parametrize("flags, error", [
    (["--input-len", "0"], "argument --input-len: expected a positive integer, got 0"),
    (["--output-len", "-4"], "argument --output-len: expected a positive integer, got -4"),
    (["--num-prompts", "0"], "argument --num-prompts: expected a positive integer, got 0"),
    (["--warmup", "-1"], "argument --warmup: expected a non-negative integer, got -1"),
    (["--timeout", "0"], "argument --timeout: expected a positive number, got 0"),
    (["--request-rate", "-2"], "argument --request-rate: expected a positive number, got -2"),
    (["--request-rate", "nan"], "argument --request-rate: expected a positive number, got nan"),
    (["--concurrency", "1,0"], "argument --concurrency: expected positive integers, got '1,0'"),
])
def test_bench_serve_refuses_sizes_out_of_range_as_it_reads_them(capsys, flags, error):
    """Were field names ("input_len and output_len must be positive") after importing the load generator."""
    line = _refusal(capsys, ["bench", "serve", "--url", "http://127.0.0.1:9", *flags])[-1]
    assert line == f"radiance bench serve: error: {error}"


def test_bench_serve_still_takes_an_infinite_rate_and_fractions():
    args = build_parser().parse_args(["bench", "serve", "--url", "http://h", "--request-rate", "inf",
                                      "--timeout", "0.5", "--warmup", "0"])
    assert (args.request_rate, args.timeout, args.warmup) == (float("inf"), 0.5, 0)


def test_the_short_usage_names_every_positional():
    from radiance.cli import _Parser

    parser = _Parser(prog="tool")
    parser.add_argument("src")
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--flag")
    assert parser.short_usage().startswith("usage: tool [options] src [rest ...]")
    assert isinstance(parser, argparse.ArgumentParser)
