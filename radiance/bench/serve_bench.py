"""`radiance bench serve`: an async load generator for any OpenAI-compatible server.

For each concurrency level it sends `num_prompts` streaming requests with at most `concurrency` in
flight (optionally arriving as a Poisson process at `request_rate` per second) and records, per
request, the time to the first token, the gaps between streamed tokens and the end-to-end latency.
Each streamed chunk that carries text counts as one token; when the server reports usage
(`stream_options.include_usage`), its completion token count wins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from radiance.bench import metrics
from radiance.bench.report import format_table
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

# Common short English words: each is about one token for BPE vocabularies, so a prompt of L
# words is close to L tokens on any model (the server's usage reports the exact count).
_WORDS = (
    "the of and to in is was for on as with by he at from his an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during "
    "into school time may years more most only over city some world would where later up such used many "
    "can state about national out known university united then made year three under since season well"
).split()


@dataclass(frozen=True)
class ServeBenchOptions:
    url: str
    model: str | None = None  # None: the first model the server lists
    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    num_prompts: int | None = None  # per level; None: 4 x concurrency, at least 8
    input_len: int = 256
    output_len: int = 128
    dataset: str | None = None  # JSONL ({"prompt", "output_len"?}) or plain text, one prompt a line
    request_rate: float = math.inf  # requests/s per level; inf: all at once (bounded by concurrency)
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = True  # ask for exactly output_len tokens (vLLM / llama.cpp / radiance extension)
    api_key: str | None = None
    timeout_s: float = 600.0
    warmup: int = 1  # requests sent (and not counted) before the first level
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency levels must be positive integers")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("num_prompts must be positive")
        if self.input_len < 1 or self.output_len < 1:
            raise ConfigError("input_len and output_len must be positive")
        if not self.request_rate > 0:
            raise ConfigError("request_rate must be positive (omit it to send all at once)")
        if not self.timeout_s > 0:  # 0 or less would fail every request as a "timeout" of the server
            raise ConfigError(f"timeout must be positive seconds, got {self.timeout_s}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be 0 or more requests, got {self.warmup}")
        if self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")

    def prompts_for(self, concurrency: int) -> int:
        return self.num_prompts if self.num_prompts is not None else max(8, 4 * concurrency)


@dataclass(frozen=True)
class PromptSpec:
    prompt: str
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None


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

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- prompts


def random_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[PromptSpec]:
    """n distinct prompts of input_len words (distinct so prefix caching cannot skip the prefill)."""
    rng = random.Random(seed)
    return [PromptSpec(" ".join(rng.choice(_WORDS) for _ in range(input_len)), output_len) for _ in range(n)]


def load_dataset(path: str, output_len: int) -> list[PromptSpec]:
    """JSONL lines {"prompt": str, "output_len": int?} or plain text lines (one prompt each)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"dataset file not found: {path}")
    specs = []
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            specs.append(_dataset_row(line, output_len, f"dataset {path} line {lineno}"))
        else:
            specs.append(PromptSpec(line, output_len))
    if not specs:
        raise ConfigError(f"dataset {path} has no prompts")
    return specs


def _dataset_row(line: str, output_len: int, where: str) -> PromptSpec:
    """One JSONL row; a prompt that is not text or an output_len that is not a positive integer (null, 2.7,
    true, 0) is the file's error, not a request the server rejects or a str(None) prompt."""
    try:
        row = json.loads(line)
        prompt = row["prompt"]
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: expected JSON with a 'prompt' field ({exc})") from None
    n = row.get("output_len", output_len)
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: 'prompt' must be a string, got {prompt!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{where}: 'output_len' must be a positive integer, got {n!r}")
    return PromptSpec(prompt, n)


def prompts_for_level(opts: ServeBenchOptions, n: int, level_seed: int,
                      pool: list[PromptSpec] | None = None) -> list[PromptSpec]:
    """The dataset's prompts in order (cycled), else n random prompts."""
    if pool:
        return [pool[i % len(pool)] for i in range(n)]
    return random_prompts(n, opts.input_len, opts.output_len, level_seed)


# --------------------------------------------------------------------------- one request


def _request_body(opts: ServeBenchOptions, model: str, spec: PromptSpec) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": spec.output_len, "stream": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _stream_event(data: str) -> dict:
    """One `data:` payload as a JSON object; anything else (`[1, 2]`, a bare string) is the server's error and
    fails this request only, not the whole run."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"stream event is not a JSON object: {data[:80]}")
    return obj


async def send_request(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, spec: PromptSpec) -> RequestResult:
    path, body = _request_body(opts, model, spec)
    result = RequestResult(ok=False)
    token_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = _stream_event(data)
                if "error" in obj:
                    result.error = f"stream error: {obj['error']}"[:200]
                    return result
                if _chunk_text(obj):
                    token_times.append(time.perf_counter())
                usage = obj.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, ValueError, OSError) as exc:  # ValueError: JSONDecodeError, _stream_event
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    end = time.perf_counter()
    if not token_times:
        result.error = "no tokens streamed"
        return result
    result.ok = True
    result.ttft_s = token_times[0] - start
    result.e2e_s = end - start
    result.itl_s = metrics.inter_token_latencies(token_times)
    result.output_tokens = max(len(token_times), usage_tokens or 0)
    return result


# --------------------------------------------------------------------------- one level


def summarize_level(concurrency: int, results: list[RequestResult], duration_s: float) -> LevelSummary:
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
        output_tok_s=metrics.mean([v for r in good
                                   if not math.isnan(v := metrics.decode_tokens_per_second(r.output_tokens, r.ttft_s, r.e2e_s))]),
        aggregate_tok_s=metrics.tokens_per_second(out_tokens, duration_s),
        request_throughput=metrics.tokens_per_second(len(good), duration_s),
        output_tokens=out_tokens,
        mean_prompt_tokens=metrics.mean(prompt_counts),
        errors=tuple(sorted({r.error for r in results if r.error}))[:5],
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
    start = time.perf_counter()

    async def one(spec: PromptSpec, offset: float) -> RequestResult:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            res = await send_request(client, opts, model, spec)
        bar.update(1)
        return res

    results = await asyncio.gather(*(one(s, o) for s, o in zip(specs, offsets)))
    duration = time.perf_counter() - start
    bar.close()
    return summarize_level(concurrency, list(results), duration)


async def discover_model(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"could not list the server's models at {client.base_url}/v1/models ({exc}); pass --model") from None


async def run_serve_bench_async(opts: ServeBenchOptions) -> dict:
    pool = load_dataset(opts.dataset, opts.output_len) if opts.dataset else None  # fail before any request
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=max(opts.concurrency) + 4, max_keepalive_connections=max(opts.concurrency) + 4)
    async with httpx.AsyncClient(base_url=opts.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(opts.timeout_s)) as client:
        model = opts.model or await discover_model(client)
        for spec in prompts_for_level(opts, opts.warmup, opts.seed - 1, pool):
            await send_request(client, opts, model, spec)
        levels = []
        for i, conc in enumerate(opts.concurrency):
            specs = prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i, pool)
            summary = await run_level(client, opts, model, conc, specs, opts.seed + i)
            logger.info("concurrency %d: %d ok, %d failed, %.1f output tok/s aggregate",
                        conc, summary.ok, summary.failed, summary.aggregate_tok_s)
            levels.append(summary)
    return {"url": opts.url, "model": model, "endpoint": opts.endpoint,
            "input_len": None if opts.dataset else opts.input_len, "output_len": opts.output_len,
            "dataset": opts.dataset, "request_rate": opts.request_rate,
            "levels": [lv.as_dict() for lv in levels]}


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
        for err in lv["errors"]:
            lines.append(f"concurrency {lv['concurrency']}: error: {err}")
    return "\n".join(lines)
