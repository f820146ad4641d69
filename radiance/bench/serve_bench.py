"""`radiance bench serve`: an async load generator for any OpenAI-compatible server.

For each concurrency level it sends `num_prompts` streaming requests with at most `concurrency` in
flight (optionally arriving as a Poisson process at `request_rate` per second) and records, per
request, the time to the first token, the gaps between streamed tokens and the end-to-end latency (to the
last event with a choice, where vLLM's benchmark ends it, not to `[DONE]`).
Output tokens are the server's usage (`stream_options.include_usage`), else, as vLLM counts them, the generated
text's by the server's /tokenize after the level (else one a streamed chunk with text); a chunk of several tokens
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
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import httpx
from tqdm import tqdm

from radiance.bench import metrics
from radiance.bench import report
from radiance.bench.serve_backend import result_backend
from radiance.bench.serve_custom import CUSTOM_SHUFFLE_SEED, load_custom_dataset, prepare_custom_prompts
from radiance.bench.serve_detailed import DETAILED_KEYS, kept_lists, per_request_lists
from radiance.bench.serve_options import ServeBenchOptions
from radiance.bench.serve_prompts import (PromptSpec, check_random_input_len, fit_to_tokens,
                                          load_dataset, oversample, prompts_for_level, sharegpt_lengths,
                                          special_tokens)
from radiance.bench.serve_server import READY_RETRY_S, discover_model, server_root, wait_until_healthy
from radiance.bench.serve_stream import Stream, http_error, read_stream, stream_problem, tokenize_texts
from radiance.bench.vllm_serve_args import request_models
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)
# the result's vLLM keys and its table are report.py's; callers know them as serve_bench's
serve_table, vllm_summary, vllm_metrics = report.serve_table, report.vllm_summary, report.vllm_metrics


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
    queue_s: float = math.nan  # the wait for a concurrency slot before the send (vLLM's client_queue_time)
    stream: Stream | None = field(default=None, repr=False, compare=False)  # its text, counted after the level

    @property
    def tpot_s(self) -> float:
        """vLLM's time per output token: (end-to-end - first token) / (output tokens - 1); NaN for one token."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan

    @property
    def short(self) -> bool:
        """Finished with fewer tokens than asked: the server stopped early (it ignores ignore_eos and min_tokens).
        Without usage the count is the chunks' or the retokenized text's, which cannot tell."""
        by_usage = self.stream is None or self.stream.completion_tokens is not None  # a retokenized text may differ
        return self.ok and not self.counted_from_chunks and by_usage and self.output_tokens < self.requested_tokens


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
    counted_from_text: int = 0  # requests without usage whose text /tokenize counted (vLLM's count)
    text_tokens: int = 0  # those requests' output tokens, so counted
    text_chunks: int = 0  # their streamed text chunks: the count without /tokenize
    interrupted: bool = False  # Ctrl-C: the requests that finished before it
    tpot_ms: metrics.LatencySummary | None = None  # per request, vLLM's TPOT
    input_tokens: int = 0  # prompt tokens of the finished requests, by the server's usage (else the client's count)
    total_tok_s: float = math.nan  # (input + output tokens) / the level's wall time: vLLM's total token throughput
    peak_output_tok_s: float = 0.0  # vLLM's peak: output tokens of the fullest one-second bucket
    peak_concurrency: int = 0  # vLLM's peak: the most requests in flight at one instant
    request_goodput: float | None = None  # vLLM's: requests/s within every --goodput objective; None without one
    # vLLM's per-request lists (serve_detailed.per_request_lists); the result keeps those serve_detailed.kept_lists
    # keeps
    per_request: dict = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict:
        return asdict(self)


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
    result.start_s = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                result.error = http_error(resp.status_code, (await resp.aread()).decode(errors="replace"))
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
    result.stream = stream
    _set_timings(result, opts.vllm_form)
    # vLLM's input tokens: the server's usage (its chat template included), else the client's count of the prompt
    result.prompt_tokens = stream.prompt_tokens if stream.prompt_tokens is not None else spec.prompt_len
    result.counted_from_chunks = stream.completion_tokens is None
    return result


def _set_timings(result: RequestResult, vllm_form: bool) -> None:
    stream = result.stream
    timings = stream.vllm_timings if vllm_form else stream.token_timings
    result.ttft_s, result.itl_s, result.e2e_s = timings(result.start_s)
    # vLLM takes the tokenized text's count as it is (calculate_metrics); radiance's lines no fewer than the chunks
    text_only = vllm_form and stream.completion_tokens is None and stream.text_tokens is not None
    result.output_tokens = stream.text_tokens if text_only else stream.output_tokens


async def count_text_tokens(client: httpx.AsyncClient, model: str, results: list[RequestResult],
                            vllm_form: bool) -> None:
    """vLLM's output tokens of the requests whose server streamed no usage: their text's (tokenize_texts), counted
    after the level's clock stopped; a server without /tokenize leaves them counted as chunks."""
    todo = [r for r in results if r.ok and r.counted_from_chunks and r.stream is not None]
    await tokenize_texts(client, model, [r.stream for r in todo])
    for result in todo:
        if result.stream.text_tokens is not None:
            result.counted_from_chunks = False
            _set_timings(result, vllm_form)


# --------------------------------------------------------------------------- one level


def summarize_level(concurrency: int, results: list[RequestResult], duration_s: float,
                    interrupted: bool = False, percentiles=(50.0, 99.0), goodput=()) -> LevelSummary:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_counts = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    summary = partial(metrics.LatencySummary.of, percentiles=percentiles)
    timed = [r for r in good if not math.isnan(r.start_s)]  # a result built without its send time has no place
    by_text = [r for r in good if r.stream is not None and r.stream.text_tokens is not None
               and r.stream.completion_tokens is None]
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
        counted_from_text=len(by_text),
        text_tokens=sum(r.output_tokens for r in by_text),
        text_chunks=sum(len(r.stream.chunk_times) for r in by_text),
        interrupted=interrupted,
        # vLLM leaves one-token answers out, and reports 0 where none is left (its `tpots or 0`)
        tpot_ms=summary([r.tpot_s * 1e3 for r in good if r.output_tokens > 1] or ([0.0] if good else [])),
        input_tokens=sum(prompt_counts),
        total_tok_s=metrics.tokens_per_second(sum(prompt_counts) + out_tokens, duration_s),
        peak_output_tok_s=metrics.peak_output_tokens_per_second(
            [r.start_s for r in timed], [r.ttft_s for r in timed], [r.itl_s for r in timed], [r.e2e_s for r in timed]),
        peak_concurrency=metrics.peak_concurrent_requests([r.start_s for r in timed], [r.e2e_s for r in timed]),
        request_goodput=metrics.tokens_per_second(metrics.good_requests(
            {"ttft": [r.ttft_s for r in good], "tpot": [0.0 if r.output_tokens <= 1 else r.tpot_s for r in good],
             "e2el": [r.e2e_s for r in good]}, dict(goodput)), duration_s) if goodput else None,
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
    # in the order sent, as vLLM's per-request lists are; None: not finished before a Ctrl-C
    slots: list[RequestResult | None] = [None] * len(specs)
    models = request_models(opts.lora_modules, model, len(specs), level_seed)  # --lora-modules: adapters
    start = time.perf_counter()

    async def one(i: int, spec: PromptSpec, offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrival = time.perf_counter()
        async with gate:
            queued = time.perf_counter() - arrival
            slots[i] = await send_request(client, opts, models[i], spec)
        slots[i].queue_s = queued
        bar.update(1)

    interrupted = False
    try:
        await asyncio.gather(*(one(i, s, o) for i, (s, o) in enumerate(zip(specs, offsets))))
    except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels the main task): keep what finished
        asyncio.current_task().uncancel()  # handled here: closing the client afterwards must not be cancelled
        interrupted = True
    duration = time.perf_counter() - start
    bar.close()
    results = [r for r in slots if r is not None]
    await count_text_tokens(client, model, results, opts.vllm_form)  # after the clock, as vLLM counts them
    summary = summarize_level(concurrency, results, duration, interrupted, opts.metric_percentiles, opts.goodput)
    return replace(summary, per_request=per_request_lists(specs, slots))


async def run_serve_bench_async(opts: ServeBenchOptions) -> dict:
    # fail before any request; vLLM shuffles a dataset with its --seed before sampling (unless --disable-shuffle),
    # radiance walks it in order
    shuffle_seed = opts.seed if opts.vllm_form and not opts.disable_shuffle else None
    if opts.custom_dataset:  # vLLM's custom JSONL, shuffled as vLLM shuffles it (its seed 0, not --seed)
        pool = load_custom_dataset(opts.dataset, opts.custom_output_len, shuffle=not opts.disable_shuffle)
    else:
        pool = load_dataset(opts.dataset, opts.output_len, shuffle_seed, vllm=opts.vllm_form) if opts.dataset else None
    _warn_if_prompts_repeat(opts, pool)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=max(opts.concurrency) + 4, max_keepalive_connections=max(opts.concurrency) + 4)
    async with httpx.AsyncClient(base_url=server_root(opts.url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(opts.timeout_s)) as client:
        if opts.ready_check_s > 0:  # a server still loading answers 503: the /tokenize counts below need it ready
            await wait_until_healthy(client, opts.ready_check_s)
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
        if pool and opts.custom_dataset:
            pool = await _custom_prompts(client, opts, model, pool)
        if pool and opts.vllm_form:  # vLLM tops a short dataset up with random draws, radiance cycles it
            pool = oversample(pool, sum(opts.prompts_for(c) for c in opts.concurrency),
                              CUSTOM_SHUFFLE_SEED if opts.custom_dataset else opts.seed)
        # vLLM's random prompts are fitted to the server's tokenizer (None: not fitted), its special tokens
        # counted once and an input length they leave no room in refused, before any request
        specials = await _special_tokens(client, opts, model) if opts.exact_input_len and not pool else None
        levels, interrupted, sent = [], False, 0
        for i, conc in enumerate(opts.concurrency):
            # a dataset is walked through across the levels: a prompt an earlier level sent would be a
            # prefix-cache hit (5.1 s against 66 ms time to first token on the embedded model)
            specs = prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i, pool, start=sent)
            if specials is not None:  # before the level's clock starts
                try:
                    specs = await fit_to_tokens(client, model, specs, opts.input_len, opts.seed + i, specials)
                except ConfigError as exc:
                    _not_fitted(exc, opts)
                    specials = None
            if i == 0:  # a vLLM line warms up with the run's first request
                await warm_up(client, opts, model, specs[0], conc)
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
            "input_len": None if opts.dataset else opts.input_len,
            "output_len": opts.custom_output_len if opts.custom_dataset else opts.output_len,
            "dataset": opts.dataset, "ignore_eos": opts.ignore_eos,
            "percentile_metrics": list(opts.percentile_metrics), "metric_percentiles": list(opts.metric_percentiles),
            # JSON has no infinity (it became null); "inf" as vLLM's benchmark writes it
            "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
            "interrupted": interrupted,
            "levels": [_with_vllm_keys(lv.as_dict(), opts) for lv in levels]}
    if len(result["levels"]) == 1:  # one level is one vLLM run: its keys where vLLM's result file has them
        result.update(report.vllm_run_keys(result_backend(opts.backend, opts.endpoint), model),
                      **result["levels"][0]["vllm"], model_id=model, num_prompts=result["levels"][0]["requests"])
        for key in DETAILED_KEYS:  # the per-request lists once, at the top as in vLLM's file
            result["levels"][0]["vllm"].pop(key, None)
    return result


def _with_vllm_keys(lv: dict, opts: ServeBenchOptions) -> dict:
    lv["vllm"] = vllm_metrics(lv, opts.percentile_metrics, opts.metric_percentiles)
    if opts.unlimited:  # vLLM writes its --max-concurrency as given, null without one
        lv["vllm"]["max_concurrency"] = None
    lv["vllm"].update(kept_lists(lv.pop("per_request"), opts.save_detailed, opts.vllm_form))
    return lv


async def _custom_prompts(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str,
                          pool: list[PromptSpec]) -> list[PromptSpec]:
    """vLLM's custom sampling: the first rows the run sends, each in the model's chat template unless
    --skip-chat-template (before any request is timed)."""
    if not opts.skip_chat_template and opts.endpoint == "chat":
        logger.warning("the custom prompts are put in the chat template here and again by the server's chat route, "
                       "as vLLM does; --skip-chat-template sends them as written")
    needed = sum(opts.prompts_for(c) for c in opts.concurrency)
    return await prepare_custom_prompts(client, model, pool[:needed], chat_template=not opts.skip_chat_template)


async def _special_tokens(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str) -> int | None:
    try:
        specials = await special_tokens(client, model)
    except ConfigError as exc:
        _not_fitted(exc, opts)
        return None
    check_random_input_len(opts.input_len, specials)
    return specials


def _not_fitted(exc: ConfigError, opts: ServeBenchOptions) -> None:
    # a server without vLLM's /tokenize: the prompts stay words, each about one token
    logger.warning("%s: the prompts are %d words (~tokens), not exactly %d tokens", exc, opts.input_len, opts.input_len)


def _warn_if_prompts_repeat(opts: ServeBenchOptions, pool: list[PromptSpec] | None) -> None:
    total = sum(opts.prompts_for(c) for c in opts.concurrency)
    if pool and total > len(pool):  # a prefix cache answers a repeated prompt without its prefill
        logger.warning("the dataset has %d prompts for the run's %d requests: prompts repeat, and a server with a "
                       "prefix cache serves the repeats faster", len(pool), total)


async def warm_up(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, first: PromptSpec | None = None,
                  concurrency: int = 1) -> None:
    """The uncounted first requests. On radiance's lines, one that fails (a wrong --url or --model, a server that is
    down) would fail every measured request the same way, so the run stops here with its error; a vLLM line warms
    up as vLLM does (vllm_warm_up)."""
    if opts.vllm_form and first is not None:
        await vllm_warm_up(client, opts, model, first, concurrency)
        return
    # random prompts from a seed no level uses, with a dataset too: a prompt the warmup sent is in the prefix cache
    # when a level sends it (seed - 1 was -1 for the default 0, which Python's random takes as 1)
    specs = prompts_for_level(opts, max(opts.warmup, 1), opts.seed + len(opts.concurrency))
    if opts.ready_check_s > 0:  # --ready-check-timeout-sec on radiance's line too: retried until it answers
        await _ready_check(client, opts, model, specs[0])
    for spec in specs[:opts.warmup]:
        result = await send_request(client, opts, model, spec)
        if not result.ok:
            raise ConfigError(f"warmup request failed: {result.error} (check --url and --model; --warmup 0 "
                              "measures without this check)")


def run_serve_bench(opts: ServeBenchOptions) -> dict:
    return asyncio.run(run_serve_bench_async(opts))


async def vllm_warm_up(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, first: PromptSpec,
                       concurrency: int) -> None:
    """vLLM's `benchmark()` before its clock starts, with the run's first request: the test request, sent until one
    succeeds for up to --ready-check-timeout-sec (vLLM's default 0 sends none since vLLM PR 30975: it was an
    unannounced warm-up), then `warmup` (--num-warmups) copies of it at once, at most `concurrency` in flight,
    whose answers are not checked."""
    if opts.ready_check_s > 0:
        await _ready_check(client, opts, model, first)
    if opts.warmup:
        logger.info("Warming up with %d requests...", opts.warmup)
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                await send_request(client, opts, model, first)
        await asyncio.gather(*(one() for _ in range(opts.warmup)))
        logger.info("Warmup run completed.")


async def _ready_check(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, first: PromptSpec) -> None:
    """vLLM's wait_for_endpoint: the test request every READY_RETRY_S until it succeeds; none by the deadline ends
    the run with vLLM's error."""
    deadline, error = time.perf_counter() + opts.ready_check_s, None
    while True:
        try:
            result = await asyncio.wait_for(send_request(client, opts, model, first),
                                            max(0.0, deadline - time.perf_counter()))
        except TimeoutError:  # vLLM keeps the last answer's error, if one came
            error = error or f"Endpoint readiness timed out after {opts.ready_check_s:g}s."
            break
        if result.ok:
            logger.info("Initial test run completed.")
            return
        error = result.error
        logger.warning("Endpoint is not ready. Error='%s'", error)
        if (left := deadline - time.perf_counter()) <= 0:
            break
        await asyncio.sleep(min(READY_RETRY_S, left))
    raise ConfigError(f"Initial test run failed - Please make sure benchmark arguments are correctly specified. "
                      f"Error: {error}")
