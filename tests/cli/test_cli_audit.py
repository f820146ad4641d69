"""`radiance` as a new user meets it: every help page says what its command does, errors name the command typed,
and flags that cannot go together are refused in one line."""

import argparse

import pytest

from radiance.cli import build_parser, main


def _pages(parser: argparse.ArgumentParser, path: str = "radiance"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _pages(sub, f"{path} {name}")


@pytest.mark.parametrize("path, parser", list(_pages(build_parser())), ids=lambda v: v if isinstance(v, str) else "")
def test_every_help_page_says_what_its_command_does(path, parser):
    """`radiance bench --help`, `bench serve --help`, `eval ppl --help`, ... showed the usage and options only."""
    assert parser.description and len(parser.description) > 20, path
    assert " ".join(parser.description.split())[:40] in " ".join(parser.format_help().split()), path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, prefix", [
    (["bench", "serve", "--url", "127.0.0.1:1"], "radiance bench serve: error:"),
    (["eval", "ppl", "--text", "/nonexistent.txt"], "radiance eval ppl: error:"),
])
def test_an_error_names_the_subcommand_typed(capsys, argv, prefix):
    """Was "radiance bench: error:", where argparse's own errors say "radiance bench serve: error:"."""
    assert main(argv) == 2
    assert _error_line(capsys).startswith(prefix)


@pytest.mark.parametrize("flags, message", [
    (["--format", "nvfp4", "--rule", "noclip"], "--rule noclip"),
    (["--format", "fp8", "--rule", "ocp"], "--rule ocp"),
    (["--format", "nvfp4", "--chunk-rows", "64"], "--chunk-rows"),
])
def test_convert_refuses_mxfp4_options_with_another_format(capsys, tmp_path, flags, message):
    """Was: accepted, and silently without effect (only the MXFP4 conversion reads them)."""
    assert main(["convert", "embedded", str(tmp_path / "out"), *flags]) == 2
    err = _error_line(capsys)
    assert err.startswith("radiance convert: error:") and message in err and "mxfp4" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["bench", "kernels", "--decode-band", "-1"], "--decode-band: expected a non-negative integer, got -1"),
    (["bench", "engine", "--prefill-graphs", "-5"], "--prefill-graphs: expected a non-negative integer, got -5"),
])
def test_bench_refuses_negative_sizes_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("mode, flags", [("kl", ["--quantization", "nvfp4"]), ("ppl", ["--rule", "noclip"]),
                                         ("kl", ["--activations", "bf16"])])
def test_eval_refuses_a_quantization_flag_beside_variants(capsys, monkeypatch, tmp_path, mode, flags):
    """Was: --variants replaced it, silently: the table showed other configurations than the flag asked for."""
    from radiance.bench import quality

    text = tmp_path / "t.txt"
    text.write_text("some text")
    monkeypatch.setattr(quality, "run_eval", lambda req, loader, **_: pytest.fail("evaluated despite the conflict"))
    assert main(["eval", mode, "--text", str(text), "--variants", "mxfp4/mse/fp8", *flags]) == 2
    err = _error_line(capsys)
    assert err.startswith(f"radiance eval {mode}: error: {flags[0]} {flags[1]}") and "--variants" in err


def test_a_multi_line_library_message_is_one_error_line(capsys, tmp_path):
    """A Llama directory whose tokenizer is a vocab.json alone: transformers' answer spans lines; was printed as it
    came."""
    from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY)
    (tmp_path / "m" / "vocab.json").write_text("{}")
    assert main(["inspect", "--tokenizer", path]) == 2
    err = _error_line(capsys)
    assert err.startswith("radiance inspect: error: cannot load the tokenizer") and path in err
