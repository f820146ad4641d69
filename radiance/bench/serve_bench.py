"""`radiance bench serve`: an async load generator for any OpenAI-compatible server.

For each concurrency level it sends `num_prompts` streaming requests with at most `concurrency` in
flight (optionally arriving as a Poisson process at `request_rate` per second) and records, per
request, the time to the first token, the gaps between streamed tokens and the end-to-end latency.
Each streamed chunk that carries text counts as one token; when the server reports usage
(`stream_options.include_usage`), its completion token count wins, and a chunk of several tokens
stands for as many inter-token gaps (the server's count of each chunk with vLLM's
`continuous_usage_stats`, else the total spread evenly). A stream that ends without a finish_reason
or `[DONE]`, or with malformed events, fails its request only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from radiance.bench import metrics
from radiance.bench.report import format_table
from radiance.bench.serve_options import ServeBenchOptions
from radiance.bench.serve_prompts import PromptSpec, load_dataset, prompts_for_level
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
    end = time.perf_counter()
    if result.error is None:
        result.error = stream_problem(stream)
    if result.error is not None:
        return result
    result.ok = True
    result.ttft_s = stream.chunk_times[0] - start
    result.e2e_s = end - start
    result.itl_s = metrics.inter_token_latencies(stream.chunk_times, stream.tokens_per_chunk())
    result.output_tokens = stream.output_tokens
    result.prompt_tokens = stream.prompt_tokens
    result.counted_from_chunks = stream.completion_tokens is None
    return result


# --------------------------------------------------------------------------- one level


def summarize_level(concurrency: int, results: list[RequestResult], duration_s: float,
                    interrupted: bool = False) -> LevelSummary:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_counts = [r.prompt_tokens for r in good if r.prompt_tokens is not None]
    return LevelSummary(
        concurrency=concurrency,
        requests=len(results),
        ok=len(good),
        failed=len(results) - len(good),
        duration_s=duration_s,
        ttft_ms=metrics.LatencySummary.of([r.ttft_s * 1e3 for r in good]),
        itl_ms=metrics.LatencySummary.of([gap * 1e3 for r in good for gap in r.itl_s]),
        e2e_s=metrics.LatencySummary.of([r.e2e_s for r in good]),
        output_tok_s=metrics.mean([v for r in good if not math.isnan(v := metrics.decode_tokens_per_second(r.itl_s))]),
        aggregate_tok_s=metrics.tokens_per_second(out_tokens, duration_s),
        request_throughput=metrics.tokens_per_second(len(good), duration_s),
        output_tokens=out_tokens,
        mean_prompt_tokens=metrics.mean(prompt_counts),
        errors=tuple(sorted({r.error for r in results if r.error}))[:5],
        short_outputs=sum(r.short for r in results),
        counted_from_chunks=sum(r.counted_from_chunks for r in good),
        interrupted=interrupted,
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
    return summarize_level(concurrency, results, duration, interrupted)


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
    pool = load_dataset(opts.dataset, opts.output_len) if opts.dataset else None  # fail before any request
    _warn_if_prompts_repeat(opts, pool)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=max(opts.concurrency) + 4, max_keepalive_connections=max(opts.concurrency) + 4)
    async with httpx.AsyncClient(base_url=server_root(opts.url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(opts.timeout_s)) as client:
        model = opts.model or await discover_model(client)
        await warm_up(client, opts, model)
        levels, interrupted, sent = [], False, 0
        for i, conc in enumerate(opts.concurrency):
            # a dataset is walked through across the levels: a prompt an earlier level sent would be a
            # prefix-cache hit (5.1 s against 66 ms time to first token on the embedded model)
            specs = prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i, pool, start=sent)
            sent += len(specs)
            summary = await run_level(client, opts, model, conc, specs, opts.seed + i)
            logger.info("concurrency %d: %d ok, %d failed, %.1f output tok/s aggregate",
                        conc, summary.ok, summary.failed, summary.aggregate_tok_s)
            if summary.requests:
                levels.append(summary)
            if summary.interrupted:
                interrupted = True
                break
    return {"url": opts.url, "model": model, "endpoint": opts.endpoint,
            "input_len": None if opts.dataset else opts.input_len, "output_len": opts.output_len,
            "dataset": opts.dataset, "ignore_eos": opts.ignore_eos,
            # JSON has no infinity (it became null); "inf" as vLLM's benchmark writes it
            "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
            "interrupted": interrupted,
            "levels": [lv.as_dict() for lv in levels]}


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


def serve_table(result: dict) -> str:
    headers = ("conc", "ok", "failed", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "E2E p50 s", "E2E p99 s", "out tok/s", "agg tok/s")
    rows = [(lv["concurrency"], lv["ok"], lv["failed"], lv["ttft_ms"]["p50"], lv["ttft_ms"]["p99"],
             lv["itl_ms"]["p50"], lv["itl_ms"]["p99"], lv["e2e_s"]["p50"], lv["e2e_s"]["p99"],
             lv["output_tok_s"], lv["aggregate_tok_s"]) for lv in result["levels"]]
    lines = [f"{result['model']} at {result['url']} ({result['endpoint']})",
             format_table(headers, rows, digits=(0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1))]
    for lv in result["levels"]:
        lines += _level_notes(lv, result.get("ignore_eos", True))
    return "\n".join(lines)


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
