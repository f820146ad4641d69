"""CLI of the measuring area: `radiance bench {kernels,engine,serve}` and `radiance eval {ppl,kl}`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from functools import partial
from pathlib import Path

from radiance.bench.options import add_engine_parser, add_kernels_parser, non_negative_int, positive_int
from radiance.bench.serve_options import DEFAULT_URL, SERVE_DEFAULTS, ServeBenchOptions
from radiance.bench.serve_vllm_extras import add_vllm_extra_flags, custom_dataset, vllm_extra_options
from radiance.bench.vllm_serve_args import (VLLM_PERCENTILE_METRICS, add_vllm_flags, is_vllm_command_line, one_of,
                                            parse_goodput, vllm_dataset, vllm_url)
from radiance.config import DTYPE_ALIASES, DTYPES, MODEL_RULES
from radiance.config_cli import errors_in_flag_words, parse_dtype
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

SERVE_LEVELS = SERVE_DEFAULTS["concurrency"]  # bench serve's default concurrency levels


def _int_list(text: str) -> tuple[int, ...]:
    """'1,8', '1 8' and '1, 8' alike (as `bench engine --concurrency 1 8` takes them)."""
    try:
        values = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas or spaces, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if min(values) < 1:  # a level of 0 requests at a time would never send one
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    """Seconds or a rate: above 0 (inf allowed), refused at once rather than after the imports of a run."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:  # NaN included
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _chunk_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count of at least 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 tokens (one predicts the next), got {value}")
    return value


# ------------------------------------------------------------------------------ bench


def _add_engine(sub) -> None:
    add_engine_parser(sub)
    engine = sub.choices["engine"]
    engine.add_argument("--plot", metavar="FILE.png",
                        help="output tok/s against concurrency and prefill tok/s against prompt length")
    engine.set_defaults(func=_with_engine_plot(engine.get_default("func")))


def _with_engine_plot(run_engine):
    """Wraps the engine bench: its rows come back through its --json file, then get plotted."""
    def run(args) -> int:
        if not getattr(args, "plot", None):
            return run_engine(args)
        import tempfile

        from radiance.bench.plot import check_plot_path, plot_engine_rows

        check_plot_path(args.plot)  # before the run, which takes minutes
        with tempfile.TemporaryDirectory() as tmp:
            keep = getattr(args, "json", None)
            args.json = keep or str(Path(tmp) / "rows.json")
            rc = run_engine(args)
            rows = _read_json(args.json)
        plot_engine_rows(args.plot, rows)
        return rc
    return run


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="load-test any OpenAI-compatible server (streaming)",
                       description="Load-test a running OpenAI-compatible server (radiance serve, vLLM, ...) with "
                                   "streamed requests at each concurrency level: throughput, time to first token "
                                   "and inter-token latency.")
    p.add_argument("--url", help=f"server base URL (default: {DEFAULT_URL}, vLLM's; or vLLM's --base-url, "
                                 "--host / --port)")
    p.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    p.add_argument("--concurrency", type=_int_list, nargs="+",
                   help=f"levels, comma- or space-separated (default: {','.join(map(str, SERVE_LEVELS))})")
    p.add_argument("--num-prompts", type=positive_int, help="requests per level (default: 4 x concurrency, at least 8)")
    # None unless given: a vLLM line's own defaults (1024 tokens) apply only where neither form's flag is given
    p.add_argument("--input-len", type=positive_int,
                   help=f"prompt length in words (~tokens; default: {SERVE_DEFAULTS['input_len']})")
    p.add_argument("--output-len", type=positive_int,
                   help=f"max_tokens of each request (default: {SERVE_DEFAULTS['output_len']})")
    p.add_argument("--dataset", help="JSONL with 'prompt' (and optional 'output_len') or ShareGPT conversations (their "
                                     "first human turn), a JSON array of either, or one prompt per line; the levels "
                                     "walk through it in order, each prompt sent once while it lasts (a vLLM "
                                     "command line shuffles it with --seed first, as vLLM does, unless "
                                     "--disable-shuffle, and tops a short one up with random draws)")
    p.add_argument("--request-rate", type=_positive_float, default=SERVE_DEFAULTS["request_rate"],
                   help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--endpoint", type=_endpoint, metavar="{completions,chat}",
                   help="/v1/completions with raw prompts (default) or /v1/chat/completions with one user message; "
                        "vLLM's paths /v1/completions and /v1/chat/completions are taken too")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="send OpenAI's fields only, not vLLM's ignore_eos, min_tokens and "
                        "stream_options.continuous_usage_stats (for servers that reject unknown fields)")
    p.add_argument("--api-key", help="sent as `Authorization: Bearer KEY` (a server started with --api-key)")
    p.add_argument("--timeout", type=_positive_float, default=SERVE_DEFAULTS["timeout_s"],
                   help="seconds to wait to connect and for each streamed chunk, not the whole answer "
                        "(default: %(default)s)")
    p.add_argument("--warmup", type=non_negative_int,
                   help="uncounted requests before the first level, checked: a failure ends the run (default: "
                        f"{SERVE_DEFAULTS['warmup']}; a vLLM line's are its --num-warmups)")
    p.add_argument("--seed", type=non_negative_int, default=SERVE_DEFAULTS["seed"],
                   help="seed of the random prompts and arrival times (and of a vLLM line's dataset shuffle); level i uses "
                        "SEED + i. Not negative: Python's "
                        "random takes -3 as 3, so levels would repeat prompts (default: %(default)s)")
    p.add_argument("--label", help="name of this configuration in --json and --plot")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="aggregate tok/s against concurrency")
    p.add_argument("--plot-with", nargs="+", default=(), metavar="RESULT.json",
                   help="earlier --json outputs to draw as extra lines in --plot")
    p.add_argument("--percentile-metrics", type=_metric_list,
                   help="latencies whose percentiles the table and JSON report, vLLM's names: ttft (time to first "
                        "token), tpot (per request: (end-to-end - TTFT) / (output tokens - 1)), itl (between "
                        f"tokens), e2el (end to end) (default: {','.join(SERVE_DEFAULTS['percentile_metrics'])}; "
                        f"a vLLM line's {','.join(VLLM_PERCENTILE_METRICS)}, vLLM's)")
    p.add_argument("--metric-percentiles", type=_percentile_list,
                   help="which percentiles, e.g. 50,90,99 (default: "
                        f"{','.join(f'{q:g}' for q in SERVE_DEFAULTS['metric_percentiles'])}; a vLLM line's 99, "
                        "vLLM's)")
    add_vllm_flags(p)
    add_vllm_extra_flags(p)
    p.set_defaults(func=run_serve)


def _endpoint(text: str) -> str:
    """radiance's names, or vLLM's --endpoint paths (any prefix belongs in --base-url, as in vLLM)."""
    kind = {"completions": "completions", "chat": "chat", "/v1/completions": "completions",
            "/v1/chat/completions": "chat"}.get(text)
    if kind is None:
        raise argparse.ArgumentTypeError(f"expected completions, chat, /v1/completions or /v1/chat/completions, "
                                         f"got {text!r} (a path prefix belongs in --url / --base-url)")
    return kind


def _metric_list(text: str) -> tuple[str, ...]:
    from radiance.bench.serve_options import PERCENTILE_METRICS

    names = tuple(v for v in text.replace(",", " ").split())
    if not names or any(n not in PERCENTILE_METRICS for n in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def _percentile_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.replace(",", " ").split())
    except ValueError:
        values = ()
    if not values or not all(0 < q <= 100 for q in values):
        raise argparse.ArgumentTypeError(f"expected percentiles in (0, 100] separated by commas, got {text!r}")
    return values


# vLLM `bench serve` flags radiance cannot honour, and why; each is an error, never a silent change of what is measured
def run_serve(args) -> int:
    from radiance.bench import serve_bench
    from radiance.bench.report import to_json

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the table
    earlier = _checked_plot_inputs(args)
    opts = serve_options(args)
    save_to = _result_path(args, opts)  # checked before the run: a bad --result-dir costs an error line, not the run
    result = serve_bench.run_serve_bench(opts)
    if result.get("interrupted") and not result["levels"]:
        return 130  # Ctrl-C before any request finished: nothing to report
    if args.label:
        result["label"] = args.label
    print(to_json(result) if args.json else serve_bench.serve_table(result))
    if save_to:
        path = Path(save_to.format(model=result["model"].rstrip("/").split("/")[-1]))
        path.write_text(to_json(result) + "\n")
        logger.info("result saved to %s", path)
    if args.plot:
        from radiance.bench.plot import plot_serve_results
        plot_serve_results(args.plot, earlier + [result])
    if result.get("interrupted"):
        return 130
    # a level none of whose requests succeeded: the server is down or refuses them (a script checks the exit code)
    return 1 if any(lv["failed"] and not lv["ok"] for lv in result["levels"]) else 0


def _result_path(args, opts: ServeBenchOptions) -> str | None:
    """vLLM's --save-result file: --result-filename in --result-dir (made if missing), by default vLLM's name
    LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json ({model} is filled in once the server named it)."""
    if not args.save_result:
        if args.result_dir or args.result_filename:  # vLLM writes nothing without --save-result: say so, not drop it
            raise ConfigError("--result-dir / --result-filename name the file of --save-result, which is not given")
        return None
    from datetime import datetime

    from radiance.bench.report import check_output_path

    name = args.result_filename
    if not name:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = (f"{args.label or args.backend or 'openai'}-{opts.request_rate}qps{conc}-{{model}}-"
                f"{datetime.now():%Y%m%d-%H%M%S}.json")
    folder = Path(args.result_dir or ".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--result-dir {folder}: {exc}") from None
    path = folder / name
    check_output_path(str(path).replace("{model}", "m"), "--result-filename")
    return str(path).replace("{", "{{").replace("}", "}}").replace("{{model}}", "{model}")


def serve_options(args) -> ServeBenchOptions:
    """The parsed `bench serve` flags as its options (the flags' defaults are the dataclass's); a vLLM command line
    (any of its own flags) with vLLM's meaning."""
    vllm = is_vllm_command_line(args)
    d = SERVE_DEFAULTS
    dataset = custom_dataset(args) or vllm_dataset(args)
    extras = vllm_extra_options(args, args.endpoint)  # --backend, the custom dataset's flags, --save-detailed
    if args.concurrency and args.max_concurrency:
        raise ConfigError("--max-concurrency N is vLLM's one level of --concurrency N: give one of them")
    if args.num_warmups is not None and args.warmup is not None:
        raise ConfigError("--num-warmups is vLLM's --warmup: give one of them")
    # vLLM sends no test request since its PR 30975, and --num-warmups copies of its first request (default 0)
    warmup = next((w for w in (args.num_warmups, args.warmup) if w is not None), 0 if vllm else d["warmup"])
    if args.vllm_ignore_eos and not args.ignore_eos:
        raise ConfigError("--ignore-eos and --no-ignore-eos contradict each other")
    input_len = one_of(args, "input_len", "random_input_len", d["input_len"], 1024 if vllm else None)
    output_len = one_of(args, "output_len", "random_output_len", d["output_len"], None)
    if args.sharegpt_output_len and args.output_len is None:  # vLLM's general --output-len overrides it
        output_len = args.sharegpt_output_len
    num_prompts = args.num_prompts or (1000 if vllm else None)  # vLLM's default --num-prompts
    if args.max_concurrency:
        levels = (args.max_concurrency,)
    elif vllm and not args.concurrency:  # vLLM's default: no limit, every request may be in flight at once
        levels = (num_prompts,)
    else:
        levels = serve_levels(args)
    # vLLM passes its --ignore-eos through as given (its requests stop at EOS without it); radiance's own lines
    # send it unless --no-ignore-eos
    ignore_eos = args.ignore_eos and (not vllm or bool(args.vllm_ignore_eos))
    # vLLM's sharegpt sizes each request by its reply, or gives each --sharegpt-output-len (or --output-len) tokens,
    # its length filter applied either way (--random-output-len is the random dataset's); radiance's --dataset rows
    # keep their own output_len
    sharegpt = bool(args.dataset_name == "sharegpt" and dataset)
    fixed_len = args.sharegpt_output_len is not None or args.output_len is not None
    return ServeBenchOptions(
        url=vllm_url(args), model=args.model, concurrency=levels, num_prompts=num_prompts,
        input_len=input_len, output_len=output_len, dataset=dataset,
        request_rate=args.request_rate, ignore_eos=ignore_eos,
        api_key=args.api_key, timeout_s=args.timeout,
        warmup=warmup, ready_check_s=args.ready_check_timeout_sec or 0, goodput=parse_goodput(args.goodput),
        seed=args.seed, progress=not (args.no_progress or args.disable_tqdm),
        percentile_metrics=args.percentile_metrics or (VLLM_PERCENTILE_METRICS if vllm else d["percentile_metrics"]),
        metric_percentiles=args.metric_percentiles or ((99.0,) if vllm else d["metric_percentiles"]),
        unlimited=vllm and not (args.max_concurrency or args.concurrency), exact_input_len=vllm and dataset is None,
        output_len_from_dataset=sharegpt and not fixed_len, sharegpt_filter=sharegpt and fixed_len,
        disable_shuffle=bool(args.disable_shuffle), vllm_form=vllm, lora_modules=tuple(args.lora_modules or ()),
        **extras)


def serve_levels(args) -> tuple[int, ...]:
    """--concurrency as one tuple: each argument holds one level or several ('1,8', '1 8')."""
    if not args.concurrency:
        return SERVE_LEVELS
    return tuple(level for group in args.concurrency for level in group)


def _checked_plot_inputs(args) -> list[dict]:
    """--plot and --plot-with checked before any request (not after a long run); returns the earlier results."""
    if args.plot_with and not args.plot:
        raise ConfigError("--plot-with needs --plot (the file to draw them in)")
    if not args.plot:
        return []
    from radiance.bench.plot import check_plot_path

    check_plot_path(args.plot)
    return [_read_serve_result(path) for path in args.plot_with]


def _read_serve_result(path: str) -> dict:
    from radiance.bench.plot import serve_series

    result = _read_json(path)
    try:
        serve_series([result])  # the keys --plot reads
    except ConfigError as exc:
        raise ConfigError(f"--plot-with {path}: {exc}") from None
    return result


def _read_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read bench result {path}: {exc}") from None


# ------------------------------------------------------------------------------ eval


def _add_eval_mode(sub, mode: str) -> None:
    what = "perplexity" if mode == "ppl" else "KL(16-bit || quantized) of next-token distributions"
    p = sub.add_parser(mode, help=f"{what} over chunks of a text file",
                       description=f"Measure {what} over chunks of a text file, for the model as served with "
                                   "each quantization asked for.")
    p.add_argument("model", nargs="?",
                   help="HF directory, GGUF file or Hugging Face Hub id (default: the embedded SmolLM2)")
    defaults = _eval_defaults(mode)
    p.add_argument("--quantization", action=_Typed, choices=("none", "mxfp4", "nvfp4"),
                   default=defaults["quantization"],
                   help="none: the checkpoint as stored, 16-bit (a quantized one dequantized; kl's reference); "
                        "mxfp4: every linear to MXFP4 with --rule; nvfp4: quantize to NVFP4, then serve as the "
                        f"engine would (requantized with --rule) (default: {defaults['quantization']})")
    p.add_argument("--rule", action=_Typed, choices=MODEL_RULES, default=defaults["rule"],
                   help="block-exponent rule of the conversion to MXFP4; none (with nvfp4): NVFP4 as W4A16 (default: mse)")
    p.add_argument("--activations", action=_Typed, choices=("fp8", "bf16"), default=defaults["activations"],
                   help="fp8 = W4A8, bf16 = W4A16 (default: fp8)")
    p.add_argument("--variants", nargs="+", metavar="QUANT[/RULE[/ACT]][+head|+head2][+fp8kv]",
                   help="several configurations in one pass over the text (one reference pass for kl), "
                        "e.g. mxfp4/mse/fp8 mxfp4/mse/bf16 nvfp4/none mxfp4/mse/fp8+head (+head: the lm_head "
                        "quantized too; +head2: as two MXFP4 terms; +fp8kv: K/V as an fp8 KV cache stores "
                        "them, e.g. none+fp8kv); replaces --quantization/--rule/--activations")
    p.add_argument("--text", required=True, help="UTF-8 text file, e.g. wikitext2-test.txt")
    p.add_argument("--chunks", type=positive_int, default=64, help="chunks of the text evaluated (default: 64)")
    p.add_argument("--chunk-len", type=_chunk_len, default=512, help="tokens per chunk, each scored on its own (default: 512)")
    p.add_argument("--first-chunk", type=non_negative_int, default=0, help="skip this many chunks (evaluate a later slice; default: 0)")
    p.add_argument("--device", help="cuda, cpu, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", type=parse_dtype, metavar="{" + ",".join((*DTYPES, *DTYPE_ALIASES)) + "}",
                   help="16-bit path dtype; vLLM's half, float and auto are taken too (default: auto, the "
                        "engine's: bfloat16 on CUDA, float32 on a CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_eval_command, eval_mode=mode, typed=())


class _Typed(argparse.Action):
    """Stores the value and notes that it was typed: `--rule mse` (the default) given beside --variants, or with
    --quantization none, is as unused as `--rule ocp`, and was let through when only a value unlike the default
    counted as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.typed = {*getattr(namespace, "typed", ()), self.dest}


def _eval_defaults(mode: str) -> dict[str, str]:
    return {"quantization": "none" if mode == "ppl" else "mxfp4", "rule": "mse", "activations": "fp8"}


def _check_variants_alone(args) -> None:
    """--variants replaces --quantization / --rule / --activations: one given beside it did nothing, silently."""
    for name in _eval_defaults(args.eval_mode):
        if name in getattr(args, "typed", ()):
            raise ConfigError(f"--{name} {getattr(args, name)} is left unused beside --variants, which names each "
                              f"configuration in full (e.g. nvfp4/none): give one or the other")


def run_eval_command(args) -> int:
    from radiance.bench import quality
    from radiance.bench.loading import eval_context_length, load_eval_model, load_eval_tokenizer, shared_checkpoints
    from radiance.bench.report import format_table, to_json

    if args.variants:
        _check_variants_alone(args)
        variants = tuple(quality.Variant.parse(v) for v in args.variants)
    else:
        variant = quality.Variant(args.quantization, args.rule, args.activations)
        typed = getattr(args, "typed", ())
        unused = variant.unused_parts(rule_given="rule" in typed, activations_given="activations" in typed)
        if unused:  # the flags as the user typed them (a default they never wrote is not quoted back)
            given = " ".join(f"--{flag} {getattr(args, flag)}" for flag in ("rule", "activations") if flag in typed)
            raise ConfigError(f"--quantization {args.quantization} {given}: {unused}")
        variants = (variant,)
    req = quality.EvalRequest(args.eval_mode, args.model, variants, args.text, args.chunks, args.chunk_len,
                              args.device, args.dtype, args.first_chunk)
    progress = not args.no_progress
    # its errors name the request's fields (chunk_len), which are flags here
    # the checkpoint opened (and its tokenizer built) once, for the text and every model loaded
    with errors_in_flag_words({}, fields=("chunk_len", "first_chunk")), shared_checkpoints():
        result = quality.run_eval(req, partial(load_eval_model, progress=progress), progress=progress,
                                  tokenizer_loader=load_eval_tokenizer, context_of=eval_context_length)
    if result.get("interrupted"):  # Ctrl-C: the chunks scored so far, then the usual exit status
        print(f"interrupted (Ctrl-C) after {result['chunks']} chunk(s)", file=sys.stderr)
    if args.json:
        print(to_json(result))
        return 130 if result.get("interrupted") else 0
    chunks = f"{result['chunks']} chunk" + ("s" if result["chunks"] != 1 else "")
    print(f"{result['model']}: {chunks} of {result['chunk_len']} tokens "
          f"({result['tokens']} scored) from {result['text']}, {result['seconds']:.0f} s")
    if "reference_ppl" in result:
        print(f"reference ({result.get('reference_label') or result['dtype'] or '16-bit'}) perplexity: "
              f"{result['reference_ppl']:.4f}")
    if args.eval_mode == "kl":
        headers = ("configuration", "ppl", "KL mean", "KL p99", "top-1 agree")
        rows = [(r["label"], r["ppl"], r["kl"], r["kl_p99"], r["top1_agreement"]) for r in result["results"]]
        print(format_table(headers, rows, digits=(0, 4, 5, 4, 4)))
    else:
        print(format_table(("configuration", "ppl"), [(r["label"], r["ppl"]) for r in result["results"]], (0, 4)))
    return 130 if result.get("interrupted") else 0


# ------------------------------------------------------------------------------ registration


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: kernels, engine, serve",
                                  description="Benchmarks: the GEMM kernels, the offline engine, or a running "
                                              "server. `radiance bench WHAT --help` explains each.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    add_kernels_parser(bench_sub)
    _add_engine(bench_sub)
    _add_serve(bench_sub)

    ev = subparsers.add_parser("eval", help="quality: perplexity and KL against the 16-bit model",
                               description="Quality of a quantized model: perplexity (ppl) or KL divergence from "
                                           "the 16-bit model (kl) over a text file. `radiance eval WHAT --help` "
                                           "explains each.")
    ev_sub = ev.add_subparsers(dest="eval_command", metavar="WHAT", required=True)
    _add_eval_mode(ev_sub, "ppl")
    _add_eval_mode(ev_sub, "kl")
