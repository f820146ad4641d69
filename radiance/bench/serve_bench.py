"""`radiance bench serve`: an async load generator for any OpenAI-compatible server.

For each concurrency level it sends `num_prompts` streaming requests with at most `concurrency` in
flight (optionally arriving as a Poisson process at `request_rate` per second) and records, per
request, the time to the first token, the gaps between streamed tokens and the end-to-end latency (to the
last event with a choice, where vLLM's benchmark ends it, not to `[DONE]`).
Each streamed chunk that carries text counts as one token; when the server reports usage
(`stream_options.include_usage`), its completion token count wins, and a chunk of several tokens
stands for as many inter-token gaps (the server's count of each chunk with vLLM's
`continuous_usage_stats`, else the total spread evenly). A `vllm bench serve` line (opts.vllm_form) times as
vLLM does instead: from the first event with a choice, one gap per such event, and counts it once any event had a
choice (an answer whose first token is EOS too). On radiance's lines a stream that ends without text or without a
finish_reason or `[DONE]` fails its request only; on both, one with malformed events or a streamed error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import httpx
from tqdm import tqdm

from radiance.bench import metrics
from radiance.bench.report import format_table
from radiance.bench.serve_options import ServeBenchOptions
from radiance.bench.serve_prompts import (PromptSpec, fit_to_tokens, load_dataset, prompts_for_level,
                                          sharegpt_lengths)
from radiance.bench.serve_stream import Stream, read_stream, stream_problem
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    requested_tokens: int = 0  # max_tokens asked for
    counted_from_chunks: bool = False  # the server reported no usage: one token per streamed chunk
    start_s: float = math.nan  # perf_counter at the send: places the request in vLLM's per-second peaks

    @property
    def tpot_s(self) -> float:
        """vLLM's time per output token: (end-to-end - first token) / (output tokens - 1); NaN for one token."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan

    @property
    def short(self) -> bool:
        """Finished with fewer tokens than asked: the server stopped early (it ignores ignore_eos and min_tokens).
        Without usage the count is the chunks', which cannot tell."""
        return self.ok and not self.counted_from_chunks and self.output_tokens < self.requested_tokens


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    requests: int
    ok: int
    failed: int
    duration_s: float
    ttft_ms: metrics.LatencySummary
    itl_ms: metrics.LatencySummary
    e2e_s: metrics.LatencySummary
    output_tok_s: float  # mean per-request decode rate (tokens after the first / their time)
    aggregate_tok_s: float  # all output tokens of the level / its wall time
    request_throughput: float  # finished requests per second
    output_tokens: int
    mean_prompt_tokens: float
    errors: tuple[str, ...] = ()
    short_outputs: int = 0  # finished with fewer tokens than output_len (the server stopped early)
    counted_from_chunks: int = 0  # requests whose server reported no usage (tokens counted as chunks)
    interrupted: bool = False  # Ctrl-C: the requests that finished before it
    tpot_ms: metrics.LatencySummary | None = None  # per request, vLLM's TPOT
    input_tokens: int = 0  # prompt tokens of the finished requests, by the server's usage (else the client's count)
    total_tok_s: float = math.nan  # (input + output tokens) / the level's wall time: vLLM's total token throughput
    peak_output_tok_s: float = 0.0  # vLLM's peak: output tokens of the fullest one-second bucket
    peak_concurrency: int = 0  # vLLM's peak: the most requests in flight at one instant

    def as_dict(self) -> dict:
        return asdict(self)


def vllm_metrics(lv: dict, percentile_metrics=("ttft", "tpot", "itl"), percentiles=(99.0,)) -> dict:
    """One level's numbers under the keys of vLLM's `bench serve` result file (mean/median/std/pNN in ms of the
    chosen metrics, as vLLM writes them)."""
    out = {"duration": lv["duration_s"], "completed": lv["ok"], "failed": lv["failed"],
           "max_concurrency": lv["concurrency"], "total_input_tokens": lv.get("input_tokens", 0),
           "total_output_tokens": lv["output_tokens"], "request_throughput": lv["request_throughput"],
           "output_throughput": lv["aggregate_tok_s"], "total_token_throughput": lv.get("total_tok_s", math.nan),
           "max_output_tokens_per_s": lv.get("peak_output_tok_s", math.nan),
           "max_concurrent_requests": lv.get("peak_concurrency")}
    for name in percentile_metrics:
        summary, scale = _metric_summary(lv, name)
        if summary is None:
            continue
        pcts = summary.get("percentiles") or {}
        out[f"mean_{name}_ms"] = summary["mean"] * scale
        out[f"median_{name}_ms"] = summary["p50"] * scale
        out[f"std_{name}_ms"] = summary.get("std", math.nan) * scale
        for q in percentiles:
            key = metrics.percentile_key(q)
            value = pcts.get(key, summary.get(key, math.nan))
            out[f"{key}_{name}_ms"] = value * scale if value is not None else math.nan
    return out


def _metric_summary(lv: dict, name: str) -> tuple[dict | None, float]:
    """The level's summary of a vLLM metric name and the factor to milliseconds (E2E is kept in seconds)."""
    key, scale = {"ttft": ("ttft_ms", 1.0), "tpot": ("tpot_ms", 1.0), "itl": ("itl_ms", 1.0),
                  "e2el": ("e2e_s", 1e3)}[name]
    return lv.get(key), scale


# --------------------------------------------------------------------------- one request


def _request_body(opts: ServeBenchOptions, model: str, spec: PromptSpec) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": spec.output_len, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        # vLLM's extensions (also SGLang's and ours): exactly output_len tokens, and the token count of every
        # chunk, so the inter-token latencies count tokens even when a chunk carries several
        body.update(ignore_eos=True, min_tokens=spec.output_len)
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


async def send_request(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, spec: PromptSpec) -> RequestResult:
    path, body = _request_body(opts, model, spec)
    result = RequestResult(ok=False, requested_tokens=spec.output_len)
    stream = Stream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
                return result
            result.error = await read_stream(resp, stream)
    except httpx.TimeoutException as exc:  # its text is empty
        result.error = f"{type(exc).__name__}: nothing from the server for {opts.timeout_s:g} s (--timeout)"
    except (httpx.HTTPError, ValueError, OSError) as exc:  # ValueError: JSONDecodeError, malformed events
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    if result.error is None:
        result.error = stream_problem(stream, opts.vllm_form)
    if result.error is not None:
        return result
    result.ok = True
    result.start_s = start
    timings = stream.vllm_timings if opts.vllm_form else stream.token_timings
    result.ttft_s, result.itl_s, result.e2e_s = timings(start)
    result.output_tokens = stream.output_tokens
    # vLLM's input tokens: the server's usage (its chat template included), else the client's count of the prompt
    result.prompt_tokens = stream.prompt_tokens if stream.prompt_tokens is not None else spec.prompt_len
    result.counted_from_chunks = stream.completion_tokens is None
    return result


# --------------------------------------------------------------------------- one level


def summarize_level(concurrency: int, results: list[RequestResult], duration_s: float,
                    interrupted: bool = False, percentiles=(50.0, 99.0)) -> LevelSummary:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_counts = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    summary = partial(metrics.LatencySummary.of, percentiles=percentiles)
    timed = [r for r in good if not math.isnan(r.start_s)]  # a result built without its send time has no place
    return LevelSummary(
        concurrency=concurrency,
        requests=len(results),
        ok=len(good),
        failed=len(results) - len(good),
        duration_s=duration_s,
        ttft_ms=summary([r.ttft_s * 1e3 for r in good]),
        itl_ms=summary([gap * 1e3 for r in good for gap in r.itl_s]),
        e2e_s=summary([r.e2e_s for r in good]),
        output_tok_s=metrics.mean([v for r in good if not math.isnan(v := metrics.decode_tokens_per_second(r.itl_s))]),
        aggregate_tok_s=metrics.tokens_per_second(out_tokens, duration_s),
        request_throughput=metrics.tokens_per_second(len(good), duration_s),
        output_tokens=out_tokens,
        mean_prompt_tokens=metrics.mean(prompt_counts),
        errors=tuple(sorted({r.error for r in results if r.error}))[:5],
        short_outputs=sum(r.short for r in results),
        counted_from_chunks=sum(r.counted_from_chunks for r in good),
        interrupted=interrupted,
        tpot_ms=summary([r.tpot_s * 1e3 for r in good if r.output_tokens > 1]),  # vLLM leaves one-token answers out
        input_tokens=sum(prompt_counts),
        total_tok_s=metrics.tokens_per_second(sum(prompt_counts) + out_tokens, duration_s),
        peak_output_tok_s=metrics.peak_output_tokens_per_second(
            [r.start_s for r in timed], [r.ttft_s for r in timed], [r.itl_s for r in timed], [r.e2e_s for r in timed]),
        peak_concurrency=metrics.peak_concurrent_requests([r.start_s for r in timed], [r.e2e_s for r in timed]),
    )


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the level start): all 0 for an infinite rate, else a Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_level(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, concurrency: int,
                    specs: list[PromptSpec], level_seed: int) -> LevelSummary:
    gate = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(len(specs), opts.request_rate, level_seed)
    bar = tqdm(total=len(specs), desc=f"concurrency {concurrency}", unit="req", disable=not opts.progress, leave=False)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def one(spec: PromptSpec, offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            results.append(await send_request(client, opts, model, spec))
        bar.update(1)

    interrupted = False
    try:
        await asyncio.gather(*(one(s, o) for s, o in zip(specs, offsets)))
    except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels the main task): keep what finished
        asyncio.current_task().uncancel()  # handled here: closing the client afterwards must not be cancelled
        interrupted = True
    duration = time.perf_counter() - start
    bar.close()
    return summarize_level(concurrency, results, duration, interrupted, opts.metric_percentiles)


def server_root(url: str) -> str:
    """--url without a trailing slash or /v1 (the openai client's base_url, which users pass here too: the
    requests went to .../v1/v1/...)."""
    root = url.rstrip("/")
    return root[:-len("/v1")] if root.endswith("/v1") else root


async def discover_model(client: httpx.AsyncClient) -> str:
    where = f"{str(client.base_url).rstrip('/')}/v1/models"  # httpx keeps a trailing slash on base_url
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:  # nothing listens there: --model would not help ("pass --model" said so)
        raise ConfigError(f"could not reach the server at {where} ({type(exc).__name__}: {exc})") from None
    if resp.status_code != 200:  # one line: httpx's own message adds a second with a link
        hint = {401: "; pass its key with --api-key", 404: "; is --url an OpenAI-compatible server?"}.get(
            resp.status_code, "; pass --model")
        raise ConfigError(f"could not list the server's models at {where} (HTTP {resp.status_code}: "
                          f"{' '.join(resp.text.split())[:200]}){hint}")
    try:
        model = resp.json()["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError):
        model = None
    if not isinstance(model, str) or not model:
        raise ConfigError(f"the server's model list at {where} names no model ({' '.join(resp.text.split())[:120]}); "
                          "pass --model")
    return model


async def run_serve_bench_async(opts: ServeBenchOptions) -> dict:
    # fail before any request; vLLM shuffles a dataset with its --seed before sampling (unless --disable-shuffle),
    # radiance walks it in order
    shuffle_seed = opts.seed if opts.vllm_form and not opts.disable_shuffle else None
    pool = load_dataset(opts.dataset, opts.output_len, shuffle_seed, vllm=opts.vllm_form) if opts.dataset else None
    _warn_if_prompts_repeat(opts, pool)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=max(opts.concurrency) + 4, max_keepalive_connections=max(opts.concurrency) + 4)
    async with httpx.AsyncClient(base_url=server_root(opts.url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(opts.timeout_s)) as client:
        model = opts.model or await discover_model(client)
        if pool and (opts.output_len_from_dataset or opts.sharegpt_filter):
            # vLLM's ShareGPT sampling; with --sharegpt-output-len N every request asks for N tokens, and vLLM's
            # length filter still drops the prompts it would not send
            fixed = None if opts.output_len_from_dataset else opts.output_len
            needed = sum(opts.prompts_for(c) for c in opts.concurrency)
            try:
                pool = await sharegpt_lengths(client, model, pool, needed, output_len=fixed)
            except ConfigError as exc:
                hint = " (or give --sharegpt-output-len N: every request N tokens, the replies' lengths unchecked)"
                raise ConfigError(f"{exc}{hint if fixed is None else ''}") from None
            _warn_if_prompts_repeat(opts, pool)  # the filter may have left fewer prompts than requests
        fit = opts.exact_input_len
        await warm_up(client, opts, model)
        levels, interrupted, sent = [], False, 0
        for i, conc in enumerate(opts.concurrency):
            # a dataset is walked through across the levels: a prompt an earlier level sent would be a
            # prefix-cache hit (5.1 s against 66 ms time to first token on the embedded model)
            specs = prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i, pool, start=sent)
            if fit and not pool:  # before the level's clock starts
                try:
                    specs = await fit_to_tokens(client, model, specs, opts.input_len, opts.seed + i)
                except ConfigError as exc:  # a server without vLLM's /tokenize: words, each about one token
                    logger.warning("%s: the prompts are %d words (~tokens), not exactly %d tokens",
                                   exc, opts.input_len, opts.input_len)
                    fit = False
            sent += len(specs)
            summary = await run_level(client, opts, model, conc, specs, opts.seed + i)
            logger.info("concurrency %d: %d ok, %d failed, %.1f output tok/s aggregate",
                        conc, summary.ok, summary.failed, summary.aggregate_tok_s)
            if summary.requests:
                levels.append(summary)
            if summary.interrupted:
                interrupted = True
                break
    result = {"url": opts.url, "model": model, "endpoint": opts.endpoint,
            "input_len": None if opts.dataset else opts.input_len, "output_len": opts.output_len,
            "dataset": opts.dataset, "ignore_eos": opts.ignore_eos,
            "percentile_metrics": list(opts.percentile_metrics), "metric_percentiles": list(opts.metric_percentiles),
            # JSON has no infinity (it became null); "inf" as vLLM's benchmark writes it
            "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
            "interrupted": interrupted,
            "levels": [_with_vllm_keys(lv.as_dict(), opts) for lv in levels]}
    if len(result["levels"]) == 1:  # one level is one vLLM run: its keys where vLLM's result file has them
        result.update(result["levels"][0]["vllm"], model_id=model, num_prompts=result["levels"][0]["requests"])
    return result


def _with_vllm_keys(lv: dict, opts: ServeBenchOptions) -> dict:
    lv["vllm"] = vllm_metrics(lv, opts.percentile_metrics, opts.metric_percentiles)
    return lv


def _warn_if_prompts_repeat(opts: ServeBenchOptions, pool: list[PromptSpec] | None) -> None:
    total = sum(opts.prompts_for(c) for c in opts.concurrency)
    if pool and total > len(pool):  # a prefix cache answers a repeated prompt without its prefill
        logger.warning("the dataset has %d prompts for the run's %d requests: prompts repeat, and a server with a "
                       "prefix cache serves the repeats faster", len(pool), total)


async def warm_up(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str) -> None:
    """The uncounted first requests. One that fails (a wrong --url or --model, a server that is down) would fail
    every measured request the same way, so the run stops here with its error."""
    # random prompts from a seed no level uses, with a dataset too: a prompt the warmup sent is in the prefix cache
    # when a level sends it (seed - 1 was -1 for the default 0, which Python's random takes as 1)
    for spec in prompts_for_level(opts, opts.warmup, opts.seed + len(opts.concurrency)):
        result = await send_request(client, opts, model, spec)
        if not result.ok:
            raise ConfigError(f"warmup request failed: {result.error} (check --url and --model; --warmup 0 "
                              "measures without this check)")


def run_serve_bench(opts: ServeBenchOptions) -> dict:
    return asyncio.run(run_serve_bench_async(opts))


_COLUMN = {"ttft": ("TTFT", "ms", "ttft_ms", 1), "tpot": ("TPOT", "ms", "tpot_ms", 2),
           "itl": ("ITL", "ms", "itl_ms", 2), "e2el": ("E2E", "s", "e2e_s", 2)}


def serve_table(result: dict) -> str:
    """One row a level: the chosen percentiles of the chosen latencies (--percentile-metrics, --metric-percentiles),
    then the rates; a run of one level adds vLLM's summary block, to compare line by line."""
    names = result.get("percentile_metrics") or ("ttft", "itl", "e2el")  # results written before the option
    qs = result.get("metric_percentiles") or (50.0, 99.0)
    cols = [(name, metrics.percentile_key(q)) for name in names for q in qs]
    headers = ("conc", "ok", "failed", *(f"{_COLUMN[n][0]} {k} {_COLUMN[n][1]}" for n, k in cols),
               "out tok/s", "agg tok/s")
    rows = [(lv["concurrency"], lv["ok"], lv["failed"], *(_level_percentile(lv, n, k) for n, k in cols),
             lv["output_tok_s"], lv["aggregate_tok_s"]) for lv in result["levels"]]
    lines = [f"{result['model']} at {result['url']} ({result['endpoint']})",
             format_table(headers, rows, digits=(0, 0, 0, *(_COLUMN[n][3] for n, _ in cols), 1, 1))]
    for lv in result["levels"]:
        lines += _level_notes(lv, result.get("ignore_eos", True))
    if len(result["levels"]) == 1 and "vllm" in result["levels"][0]:
        lines += ["", vllm_summary(result["levels"][0]["vllm"], names, qs, result.get("request_rate"))]
    return "\n".join(lines)


def _level_percentile(lv: dict, name: str, key: str) -> float:
    summary = lv.get(_COLUMN[name][2]) or {}
    value = (summary.get("percentiles") or {}).get(key, summary.get(key))
    return math.nan if value is None else value


def vllm_summary(v: dict, names, qs, request_rate=None) -> str:
    """vLLM's "Serving Benchmark Result" block, its lines and labels, from vllm_metrics' keys."""
    def line(label, value, fmt=".2f"):
        text = "nan" if isinstance(value, float) and math.isnan(value) else format(value, fmt)
        return f"{label:<40} {text:<10}".rstrip()

    out = [" Serving Benchmark Result ".center(50, "="), line("Successful requests:", v["completed"], "d"),
           line("Failed requests:", v["failed"], "d"), line("Maximum request concurrency:", v["max_concurrency"], "d")]
    if request_rate not in (None, "inf"):
        out.append(line("Request rate configured (RPS):", request_rate))
    out += [line("Benchmark duration (s):", v["duration"]), line("Total input tokens:", v["total_input_tokens"], "d"),
            line("Total generated tokens:", v["total_output_tokens"], "d"),
            line("Request throughput (req/s):", v["request_throughput"]),
            line("Output token throughput (tok/s):", v["output_throughput"])]
    if v.get("max_concurrent_requests") is not None:  # results written before the peaks have none
        out += [line("Peak output token throughput (tok/s):", v["max_output_tokens_per_s"]),
                line("Peak concurrent requests:", v["max_concurrent_requests"])]  # vLLM prints it as 8.00
    out.append(line("Total token throughput (tok/s):", v["total_token_throughput"]))
    headers = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
               "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in names:
        if f"mean_{name}_ms" not in v:
            continue
        label = name.upper()
        out += [headers[name].center(50, "-"), line(f"Mean {label} (ms):", v[f"mean_{name}_ms"]),
                line(f"Median {label} (ms):", v[f"median_{name}_ms"])]
        out += [line(f"{key.upper()} {label} (ms):", v[f"{key}_{name}_ms"])
                for key in (metrics.percentile_key(q) for q in qs)]
    out.append("=" * 50)
    return "\n".join(out)


def _level_notes(lv: dict, ignore_eos: bool) -> list[str]:
    where = f"concurrency {lv['concurrency']}"
    notes = [f"{where}: error: {err}" for err in lv["errors"]]
    if lv.get("counted_from_chunks"):
        notes.append(f"{where}: {lv['counted_from_chunks']} of {lv['ok']} requests came without usage: their tokens "
                     "are counted as streamed chunks (too few where a chunk carries several)")
    if lv.get("short_outputs"):
        why = " (the server may not honour ignore_eos / min_tokens)" if ignore_eos else ""
        notes.append(f"{where}: {lv['short_outputs']} of {lv['ok']} requests stopped before their max_tokens{why}; "
                     "tok/s counts the tokens sent")
    if lv.get("interrupted"):
        notes.append(f"{where}: interrupted (Ctrl-C) after {lv['requests']} request(s); its numbers cover those only")
    return notes
