import json

import pytest

from radiance.cli import build_parser, main


def test_bench_serve_cli_json_and_plot(fake_server, tmp_path, capsys):
    plot = tmp_path / "serve.png"
    rc = main(["bench", "serve", "--url", fake_server.url, "--concurrency", "1,2", "--num-prompts", "2",
               "--input-len", "4", "--output-len", "3", "--json", "--label", "fake", "--warmup", "0",
               "--plot", str(plot)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["label"] == "fake"
    assert result["request_rate"] == "inf"  # all at once (it was written as null)
    assert [(lv["concurrency"], lv["ok"], lv["output_tokens"]) for lv in result["levels"]] == [(1, 2, 6), (2, 2, 6)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second run drawn together with the first one's JSON
    first = tmp_path / "first.json"
    first.write_text(json.dumps(result))
    rc = main(["bench", "serve", "--url", fake_server.url, "--concurrency", "1", "--num-prompts", "1",
               "--input-len", "2", "--output-len", "2", "--warmup", "0", "--plot", str(plot), "--plot-with", str(first)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TTFT p50 ms" in out and "agg tok/s" in out


def test_cli_errors_are_one_line(capsys, tmp_path):
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--dataset",
               str(tmp_path / "nope.jsonl")])
    assert rc == 2
    assert "dataset file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--url", "x", "--concurrency", "1,a"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "kl", "--text", "t.txt", "--quantization", "int4"])
    args = build_parser().parse_args(["eval", "kl", "--text", "t.txt"])
    assert (args.quantization, args.rule, args.activations, args.chunks, args.chunk_len) == ("mxfp4", "mse", "fp8", 64, 512)
    rc = main(["eval", "kl", "--text", str(tmp_path / "t.txt"), "--variants", "mxfp4/none"])
    assert rc == 2
    assert "rule 'none' only applies" in capsys.readouterr().err


def test_eval_refuses_synthetic_models(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    rc = main(["eval", "ppl", "synthetic:llama-3.1-8b", "--text", str(text), "--device", "cpu"])
    assert rc == 2
    assert "synthetic models have no tokenizer" in capsys.readouterr().err


def test_help_builds_every_parser_without_importing_torch():
    """`radiance --help` (and every subcommand's) stays instant: the parsers live apart from the benchmarks."""
    import subprocess
    import sys

    code = ("import sys; from radiance.cli import build_parser; p = build_parser(); "
            "a = p.parse_args(['bench', 'kernels', '--shapes', '64x128', '--m', '1']); "
            "b = p.parse_args(['bench', 'engine', 'synthetic:qwen3-32b', '--quantization', 'none']); "
            "assert a.shapes == [(64, 128)] and b.variants == ['none'], (a, b); "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bench_kernels_runs_its_benchmark_when_called(monkeypatch):
    """The subcommand's func imports radiance.bench.kernels only when it runs, and runs its entry point."""
    from radiance.bench import kernels

    seen = []
    monkeypatch.setattr(kernels, "run_kernels_bench", lambda args: seen.append(args.m) or 0)
    args = build_parser().parse_args(["bench", "kernels", "--m", "1", "16"])
    assert args.func(args) == 0 and seen == [[1, 16]]


@pytest.mark.parametrize("extra, message", [
    (["--plot", "{tmp}/out.jpg"], ".png"),
    (["--plot", "{tmp}/no/such/dir/out.png"], "no/such/dir"),
    (["--plot", "{tmp}"], ".png"),
    (["--plot", "{tmp}/out.png", "--plot-with", "{tmp}/missing.json"], "missing.json"),
    (["--plot", "{tmp}/out.png", "--plot-with", "{tmp}/object.json"], "object.json"),
    (["--plot", "{tmp}/out.png", "--plot-with", "{tmp}/list.json"], "list.json"),
    (["--plot-with", "{tmp}/object.json"], "--plot-with needs --plot"),
])
def test_serve_plot_options_fail_before_the_benchmark(monkeypatch, tmp_path, capsys, extra, message):
    """A bad --plot / --plot-with is one error line before any request, not a traceback after a long run."""
    from radiance.bench import serve_bench

    (tmp_path / "object.json").write_text('{"a": 1}')
    (tmp_path / "list.json").write_text("[1, 2]")
    ran = []
    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda opts: ran.append(opts))
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "m"]
              + [a.format(tmp=tmp_path) for a in extra])
    assert rc == 2 and not ran
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_eval_device_errors_are_one_line(monkeypatch, tmp_path, capsys):
    import torch

    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    rc = main(["eval", "ppl", "--text", str(text), "--device", "gpu0"])
    assert rc == 2 and "gpu0" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = main(["eval", "ppl", "--text", str(text), "--device", "cuda"])
    assert rc == 2 and "CUDA" in capsys.readouterr().err


def test_eval_dtype_help_states_the_engine_default(capsys):
    """The engine's CPU default is float32 (config.ModelConfig.dtype), which --help must say."""
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "float32 on a CPU" in help_text and "AVX2" not in help_text


def test_bench_serve_flags_default_to_the_options_dataclass(monkeypatch):
    """The flags are written by hand (their help says more than a field's comment): their defaults must still be
    ServeBenchOptions', which the Python API uses."""
    import dataclasses

    from radiance.bench import cli as bench_cli, serve_bench

    built = {}

    def run_serve_bench(opts):
        built["opts"] = opts
        return {"levels": []}

    monkeypatch.setattr(serve_bench, "run_serve_bench", run_serve_bench)
    monkeypatch.setattr(serve_bench, "serve_table", lambda result: "")
    args = build_parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:1"])
    bench_cli.run_serve(args)
    given = built["opts"]
    for field in dataclasses.fields(serve_bench.ServeBenchOptions):
        if field.name not in ("url", "progress"):
            assert getattr(given, field.name) == field.default, field.name


@pytest.mark.parametrize("levels, code", [
    ([{"ok": 4, "failed": 0}, {"ok": 4, "failed": 0}], 0),
    ([{"ok": 3, "failed": 1}, {"ok": 4, "failed": 0}], 0),  # a failed request among successes: reported, not fatal
    ([{"ok": 1, "failed": 3}, {"ok": 0, "failed": 4}], 1),  # the server died during the run: a whole level failed
])
def test_bench_serve_exits_1_when_a_whole_level_failed(monkeypatch, levels, code):
    from radiance.bench import cli as bench_cli
    from radiance.bench import serve_bench

    monkeypatch.setattr(serve_bench, "run_serve_bench", lambda opts: {"levels": levels, "model": "m"})
    monkeypatch.setattr(serve_bench, "serve_table", lambda result: "")
    args = build_parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:1"])
    assert bench_cli.run_serve(args) == code


def test_bench_engine_help_lists_every_synthetic_model(capsys):
    from radiance.bench.synthetic import SYNTHETIC_CONFIGS

    with pytest.raises(SystemExit):
        main(["bench", "engine", "--help"])
    help_text = "".join(capsys.readouterr().out.split())
    assert all(f"synthetic:{name}" in help_text for name in SYNTHETIC_CONFIGS)
