"""A `vllm bench serve` command line runs as `radiance bench serve`, with vLLM's meaning."""

import json
import math

import pytest

from radiance.bench import cli as bench_cli, metrics, serve_bench
from radiance.cli import build_parser, main

VLLM_LINE = ("--backend openai-chat --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model M "
             "--dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 200 "
             "--max-concurrency 32 --request-rate inf --ignore-eos --seed 0 --save-result --result-dir out "
             "--result-filename r.json --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 "
             "--tokenizer M --disable-tqdm").split()


def options(argv: list[str]):
    return bench_cli.serve_options(build_parser().parse_args(["bench", "serve", *argv]))


def test_a_vllm_command_line_maps_onto_radiance_options():
    opts = options(VLLM_LINE)
    assert (opts.url, opts.model, opts.endpoint) == ("http://127.0.0.1:8000", "M", "chat")
    assert (opts.concurrency, opts.num_prompts, opts.input_len, opts.output_len) == ((32,), 200, 1024, 128)
    assert opts.request_rate == math.inf and opts.ignore_eos and not opts.progress
    assert opts.percentile_metrics == ("ttft", "tpot", "itl", "e2el") and opts.metric_percentiles == (50, 90, 99)
    assert opts.exact_input_len and opts.warmup == 0 and opts.ready_check_s == 0  # vLLM sends none before the run


def test_vllm_defaults_apply_to_a_vllm_line_only():
    # vLLM's: one level, every request at once (no --max-concurrency), 1000 prompts of 1024 tokens, 127.0.0.1:8000
    opts = options(["--host", "10.0.0.2", "--port", "9000", "--dataset-name", "random"])
    assert opts.url == "http://10.0.0.2:9000"
    assert (opts.concurrency, opts.num_prompts, opts.input_len, opts.output_len) == ((1000,), 1000, 1024, 128)
    assert opts.endpoint == "completions" and not opts.ignore_eos  # vLLM passes --ignore-eos as given
    assert options(["--dataset-name", "random", "--ignore-eos"]).ignore_eos
    # radiance's own line keeps its levels and lengths, at vLLM's default URL
    opts = options([])
    assert (opts.url, opts.concurrency, opts.num_prompts, opts.input_len) == (
        "http://127.0.0.1:8000", (1, 8, 32, 128), None, 256)
    assert not opts.exact_input_len


@pytest.mark.parametrize("argv, lengths", [
    (["--max-concurrency", "2", "--input-len", "256"], (256, 128)),  # radiance's default value, given: kept
    (["--random-input-len", "300", "--input-len", "256", "--output-len", "128", "--random-output-len", "9"],
     (256, 128)),  # vLLM's general --input-len / --output-len win over the random dataset's
    (["--max-concurrency", "2"], (1024, 128)),
])
def test_a_given_input_len_is_kept_even_at_radiance_s_default_value(argv, lengths):
    """--input-len 256 beside a vLLM flag read as "not given" (it equals radiance's default): 1024 tokens were sent."""
    opts = options(argv)
    assert (opts.input_len, opts.output_len) == lengths


def test_radiance_s_own_dataset_beside_a_vllm_flag_keeps_its_rows_lengths(tmp_path):
    """A --dataset JSONL with a vLLM flag (--max-concurrency) was sized as ShareGPT: every row without a reply
    dropped, then "the dataset has no conversation vLLM's sharegpt would send"."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a", "output_len": 5}\n')
    opts = options(["--dataset", str(data), "--max-concurrency", "1"])
    assert not opts.output_len_from_dataset


def test_a_sharegpt_line_sizes_requests_by_the_replies_without_ignore_eos(tmp_path):
    data = tmp_path / "sg.json"
    data.write_text("[]")
    opts = options(["--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-warmups", "2"])
    assert opts.dataset == str(data) and opts.output_len_from_dataset
    assert not opts.ignore_eos and not opts.exact_input_len  # vLLM sends no ignore_eos for sharegpt
    assert opts.warmup == 2
    opts = options(["--dataset-name", "sharegpt", "--dataset-path", str(data), "--sharegpt-output-len", "64",
                    "--ignore-eos"])
    assert (opts.output_len, opts.output_len_from_dataset, opts.ignore_eos) == (64, False, True)
    assert opts.sharegpt_filter  # vLLM's length filter still runs on the prompts


@pytest.mark.parametrize("argv, output_len, from_replies", [
    (["--sharegpt-output-len", "64"], 64, False),
    (["--output-len", "32", "--sharegpt-output-len", "64"], 32, False),  # vLLM: --output-len overrides it
    (["--random-output-len", "9"], 9, True),  # the random dataset's: a ShareGPT sample is still sized by its replies
])
def test_sharegpt_output_lengths_as_vllm_maps_them(tmp_path, argv, output_len, from_replies):
    data = tmp_path / "sg.json"
    data.write_text("[]")
    opts = options(["--dataset-name", "sharegpt", "--dataset-path", str(data), *argv])
    assert (opts.output_len, opts.output_len_from_dataset, opts.sharegpt_filter) == (
        output_len, from_replies, not from_replies)


def test_disable_shuffle_is_honoured_not_refused(tmp_path):
    """vLLM's --disable-shuffle was refused with "a dataset is walked in its order", the opposite of what a vLLM
    line does (it shuffles with --seed): it now keeps the file's order."""
    data = tmp_path / "sg.json"
    data.write_text("[]")
    opts = options(["--dataset-name", "sharegpt", "--dataset-path", str(data), "--disable-shuffle"])
    assert opts.disable_shuffle and opts.vllm_form
    assert not options(["--dataset-name", "sharegpt", "--dataset-path", str(data)]).disable_shuffle
    assert options(["--disable-shuffle"]).vllm_form  # a flag of vLLM's: the line is vLLM's


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sonnet"], "--dataset-name sonnet is not supported"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "takes no --dataset-path"),
    (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "--backend openai sends completions"),
    (["--max-concurrency", "4", "--concurrency", "8"], "give one of them"),
    (["--url", "http://a:1", "--base-url", "http://b:2"], "name the server twice"),
    (["--result-dir", "out"], "--save-result, which is not given"),
])
def test_contradictions_and_unsupported_values_are_errors(argv, message, capsys):
    rc = main(["bench", "serve", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, accepted", [
    (["--append-result"], False), (["--burstiness", "0.5"], False), (["--burstiness", "1.0"], True),
    (["--temperature", "0"], True), (["--temperature", "0.7"], False), (["--random-range-ratio", "0.1"], False),
    (["--profile"], False),
])
def test_vllm_flags_radiance_cannot_honour_are_refused_by_name(argv, accepted, capsys):
    if accepted:
        build_parser().parse_args(["bench", "serve", *argv])
        return
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", *argv])
    assert f"vLLM's {argv[0]} is not supported" in capsys.readouterr().err


def test_tpot_and_percentiles_as_vllm_defines_them():
    def ok(ttft, e2e, tokens, itl):
        return serve_bench.RequestResult(ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, itl_s=itl,
                                         prompt_tokens=10, requested_tokens=tokens)
    results = [ok(0.1, 0.5, 5, [0.1] * 4), ok(0.2, 1.0, 9, [0.1] * 8), ok(0.3, 0.3, 1, [])]
    lv = serve_bench.summarize_level(2, results, 2.0, percentiles=(50, 90)).as_dict()
    # TPOT = (e2e - ttft) / (tokens - 1) per request; a one-token answer has none
    assert lv["tpot_ms"]["mean"] == pytest.approx(100.0) and lv["tpot_ms"]["std"] == pytest.approx(0.0)
    assert lv["input_tokens"] == 30 and lv["total_tok_s"] == pytest.approx((30 + 15) / 2.0)
    v = serve_bench.vllm_metrics(lv, ("ttft", "tpot", "e2el"), (50, 90))
    assert v["p90_ttft_ms"] == pytest.approx(metrics.percentile([100, 200, 300], 90))
    assert v["median_e2el_ms"] == pytest.approx(500.0) and v["std_ttft_ms"] == pytest.approx(81.6497, rel=1e-4)
    assert "p99_ttft_ms" not in v and "mean_itl_ms" not in v  # only the metrics and percentiles chosen
    assert (v["completed"], v["total_output_tokens"], v["output_throughput"]) == (3, 15, 7.5)


def test_the_vllm_line_runs_saves_its_result_and_prints_vllm_block(fake_server, tmp_path, capsys):
    port = fake_server.url.rsplit(":", 1)[1]
    rc = main(["bench", "serve", "--backend", "openai-chat", "--host", "127.0.0.1", "--port", port,
               "--endpoint", "/v1/chat/completions", "--dataset-name", "random", "--random-input-len", "12",
               "--random-output-len", "4", "--num-prompts", "6", "--max-concurrency", "3", "--request-rate", "inf",
               "--ignore-eos", "--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json",
               "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90", "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 TPOT (ms):" in out and "Total token throughput" in out
    assert "TPOT p90 ms" in out and "ITL" not in out  # itl was not chosen
    saved = json.loads((tmp_path / "out" / "r.json").read_text())
    assert (saved["completed"], saved["failed"], saved["max_concurrency"]) == (6, 0, 3)
    assert saved["total_output_tokens"] == 6 * 4 and saved["total_input_tokens"] == 6 * 12
    assert {"p50_ttft_ms", "p90_ttft_ms", "p90_tpot_ms", "p90_e2el_ms", "std_e2el_ms"} <= saved.keys()
    assert not any(k.endswith("_itl_ms") or k.startswith("p99_") for k in saved)
    assert saved["levels"][0]["tpot_ms"]["percentiles"].keys() == {"p50", "p90"}
    assert saved["mean_tpot_ms"] == pytest.approx(fake_server.token_gap_s * 1e3, rel=0.5)


def _tokenize_client(count):
    """A client whose server has only vLLM's /tokenize, counting with `count(text)`."""
    import httpx

    def handler(request):
        return httpx.Response(200, json={"count": count(json.loads(request.content)["prompt"])})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t")


def test_random_prompts_are_fitted_to_exact_token_counts():
    import asyncio

    from radiance.bench import serve_prompts

    def count(text):  # words of more than 3 letters take two tokens: words are not tokens
        return sum(1 + (len(w) > 3) for w in text.split())

    async def fit():
        async with _tokenize_client(count) as client:
            specs = serve_prompts.random_prompts(5, 40, 4, seed=1)
            return await serve_prompts.fit_to_tokens(client, "m", specs, 40, seed=1)

    fitted = asyncio.run(fit())
    # exact, or one short where a two-token word straddles the length
    assert all(39 <= count(s.prompt) <= 40 for s in fitted) and len({s.prompt for s in fitted}) == 5
    assert sum(count(s.prompt) == 40 for s in fitted) >= 3


def test_sharegpt_requests_take_their_replies_token_counts(tmp_path):
    import asyncio

    from radiance.bench import serve_prompts

    def conv(q, a):
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([conv("one two three four", "a b c d e f"), conv("too short", "a b c d e"),
                                conv("w " * 1100, "a b c d"), conv("five six seven eight", "x y z w v u t s"),
                                conv("nine ten eleven twelve", "p q r s t")]))
    pool = serve_prompts.load_dataset(str(data), 128)

    async def lengths(needed):
        async with _tokenize_client(lambda text: len(text.split())) as client:
            return await serve_prompts.sharegpt_lengths(client, "m", pool, needed)

    # vLLM's filter: prompt and reply of 4 tokens or more, the prompt at most 1024
    assert [(s.prompt, s.output_len) for s in asyncio.run(lengths(10))] == [
        ("one two three four", 6), ("five six seven eight", 8), ("nine ten eleven twelve", 5)]
    assert len(asyncio.run(lengths(2))) == 2  # counted only as far as needed


def test_prompts_left_by_the_sharegpt_filter_warn_when_they_repeat(fake_server, tmp_path, monkeypatch, caplog):
    """The repeat warning looked at the file before vLLM's length filter: 4 conversations, 1 left, 3 requests sent
    that one prompt 3 times without a word."""
    from radiance.bench.serve_options import ServeBenchOptions
    from radiance.bench.serve_prompts import PromptSpec

    data = tmp_path / "sg.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "output_len": 2}) + "\n" for i in range(4)))

    async def one_left(client, model, pool, needed, output_len=None):
        return [PromptSpec(pool[0].prompt, 2)]

    monkeypatch.setattr(serve_bench, "sharegpt_lengths", one_left)
    opts = ServeBenchOptions(url=fake_server.url, concurrency=(1,), num_prompts=3, dataset=str(data), warmup=0,
                             progress=False, output_len_from_dataset=True)
    with caplog.at_level("WARNING", logger="radiance.bench.serve_bench"):
        serve_bench.run_serve_bench(opts)
    assert "the dataset has 1 prompts for the run's 3 requests" in caplog.text


@pytest.mark.parametrize("argv, vllm", [
    ([], False), (["--concurrency", "4", "--seed", "3"], False), (["--max-concurrency", "4"], True),
    (["--dataset-name", "random"], True), (["--ignore-eos"], True), (["--port", "9000"], True),
])
def test_the_vllm_form_of_a_line_is_decided_by_its_vllm_flags(argv, vllm):
    """The options' vllm_form (vLLM's sampling and timing) follows from the same flags as vLLM's defaults."""
    from radiance.bench.vllm_serve_args import is_vllm_command_line

    assert is_vllm_command_line(build_parser().parse_args(["bench", "serve", *argv])) is vllm
    assert options(argv).vllm_form is vllm
