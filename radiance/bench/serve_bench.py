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
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

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
    ignore_eos: bool = True  # send vLLM's extensions (ignore_eos, min_tokens: exactly output_len tokens;
    # continuous_usage_stats: the tokens of each chunk); False: OpenAI's fields only
    api_key: str | None = None
    timeout_s: float = 600.0
    warmup: int = 1  # requests sent (and not counted) before the first level
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        _check_url(self.url)
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


def _check_url(url: str) -> None:
    """http(s)://HOST[:PORT], checked before any request: a port past 65535 was an OverflowError traceback, and a
    URL without its scheme failed every request as an 'unsupported protocol'."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise ConfigError(f"--url {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url must be http://HOST[:PORT] or https://..., got {url!r}")


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
    requested_tokens: int = 0  # max_tokens asked for

    @property
    def short(self) -> bool:
        """Finished with fewer tokens than asked: the server stopped early (it ignores ignore_eos and min_tokens)."""
        return self.ok and self.output_tokens < self.requested_tokens


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
    interrupted: bool = False  # Ctrl-C: the requests that finished before it

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- prompts


def random_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[PromptSpec]:
    """n distinct prompts of input_len words (distinct so prefix caching cannot skip the prefill)."""
    rng = random.Random(seed)
    return [PromptSpec(" ".join(rng.choice(_WORDS) for _ in range(input_len)), output_len) for _ in range(n)]


def load_dataset(path: str, output_len: int) -> list[PromptSpec]:
    """A JSON array (ShareGPT's {"conversations": [...]} or {"prompt", "output_len"?} objects), JSONL lines
    {"prompt": str, "output_len": int?} or plain text lines (one prompt each)."""
    text = _dataset_text(path)
    array = _json_array(text, path)
    if array is not None:
        items = (_array_item(item, output_len, f"dataset {path} item {i}") for i, item in enumerate(array))
        specs = [spec for spec in items if spec is not None]
    else:
        specs = _dataset_lines(text, output_len, path)
    if not specs:
        raise ConfigError(f"dataset {path} has no prompts")
    return specs


def _dataset_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"dataset file not found: {path}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"dataset {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _json_array(text: str, path: str) -> list | None:
    """The file as one JSON array (ShareGPT's layout), None when it is lines. A .json file that starts like an
    array must parse: read as lines, a broken one would send its fragments as prompts."""
    if not text.lstrip().startswith("["):
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        if path.lower().endswith(".json"):
            raise ConfigError(f"dataset {path} is not valid JSON ({exc})") from None
        return None  # text lines, the first of which starts with "["


def _array_item(item, output_len: int, where: str) -> PromptSpec | None:
    """One {"prompt", "output_len"?} object, or a ShareGPT conversation's first human turn (None when it has none:
    ShareGPT holds some conversations that open with the model)."""
    if isinstance(item, dict) and "conversations" in item:
        turns = item["conversations"]
        if not isinstance(turns, list):
            raise ConfigError(f"{where}: 'conversations' must be a list of turns")
        first = next((t for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
        if first is None or not isinstance(first.get("value"), str) or not first["value"].strip():
            return None
        return PromptSpec(first["value"], output_len)
    return _prompt_row(item, output_len, where)


def _dataset_lines(text: str, output_len: int, path: str) -> list[PromptSpec]:
    specs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            specs.append(_dataset_row(line, output_len, f"dataset {path} line {lineno}"))
        else:
            specs.append(PromptSpec(line, output_len))
    return specs


def _dataset_row(line: str, output_len: int, where: str) -> PromptSpec:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: expected JSON with a 'prompt' field ({exc})") from None
    return _prompt_row(row, output_len, where)


def _prompt_row(row, output_len: int, where: str) -> PromptSpec:
    """One {"prompt", "output_len"?} object; a prompt that is not text or an output_len that is not a positive
    integer (null, 2.7, true, 0) is the file's error, not a request the server rejects or a str(None) prompt."""
    if not isinstance(row, dict) or "prompt" not in row:
        raise ConfigError(f"{where}: expected JSON with a 'prompt' field, got {str(row)[:60]}")
    prompt, n = row["prompt"], row.get("output_len", output_len)
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
        # vLLM's extensions (also SGLang's and ours): exactly output_len tokens, and the token count of every
        # chunk, so the inter-token latencies count tokens even when a chunk carries several
        body.update(ignore_eos=True, min_tokens=spec.output_len)
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _text_field(where: dict, key: str) -> str:
    value = where.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"stream event {key!r} is not text: {str(value)[:80]}")
    return value or ""


def _first_choice(obj: dict) -> dict | None:
    """The event's choice, None for a usage-only chunk (`choices: []`); any other shape is the server's error."""
    choices = obj.get("choices") or []
    if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
        raise ValueError(f"stream event has a malformed choice: {str(choices)[:80]}")
    return choices[0] if choices else None


def _chunk_text(choice: dict | None) -> str:
    if choice is None:
        return ""
    if "delta" not in choice:
        return _text_field(choice, "text")
    delta = choice["delta"] or {}
    if not isinstance(delta, dict):
        raise ValueError(f"stream event has a malformed delta: {str(delta)[:80]}")
    return "".join(_text_field(delta, key) for key in ("content", "reasoning_content", "reasoning"))


def _usage_count(usage: dict, key: str) -> int | None:
    value = usage.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"stream event usage {key!r} is not a count: {str(value)[:80]}")
    return value


def _stream_event(data: str) -> dict:
    """One `data:` payload as a JSON object; anything else (`[1, 2]`, a bare string) is the server's error and
    fails this request only, not the whole run."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"stream event is not a JSON object: {data[:80]}")
    return obj


@dataclass
class _Stream:
    """What one streamed answer delivered: when each chunk with text came and the usage the server reported."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_usage: list[int | None] = field(default_factory=list)  # completion_tokens so far, sent with each text chunk
    completion_tokens: int | None = None  # the last usage's
    prompt_tokens: int | None = None
    finished: bool = False  # a finish_reason or [DONE] came: the answer is whole
    events: int = 0  # `data:` lines read

    def add(self, obj: dict, now: float) -> None:
        choice = _first_choice(obj)
        usage = obj.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise ValueError(f"stream event usage is not an object: {str(usage)[:80]}")
        completion = _usage_count(usage, "completion_tokens") if usage else None
        if _chunk_text(choice):
            self.chunk_times.append(now)
            self.chunk_usage.append(completion)
        if choice is not None and choice.get("finish_reason"):
            self.finished = True
        if usage:
            self.completion_tokens = completion if completion is not None else self.completion_tokens
            self.prompt_tokens = _usage_count(usage, "prompt_tokens")

    @property
    def output_tokens(self) -> int:
        return max(len(self.chunk_times), self.completion_tokens or 0)

    def tokens_per_chunk(self) -> list[int]:
        """The server's counts when every text chunk carried its usage (continuous_usage_stats) and they add up,
        else the total spread evenly over the chunks."""
        if self.chunk_usage and None not in self.chunk_usage:
            counts = [b - a for a, b in zip([0, *self.chunk_usage], self.chunk_usage)]
            if min(counts) >= 1:
                return counts
        return metrics.tokens_per_chunk(self.output_tokens, len(self.chunk_times))


async def _read_stream(resp: httpx.Response, stream: _Stream) -> str | None:
    """Reads the events into `stream`; returns the error the server streamed, if any."""
    async for line in resp.aiter_lines():
        if line.startswith("error:"):  # llama.cpp's server streams its errors as `error: {...}` lines
            return f"stream error: {line[6:].strip()}"[:200]
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        stream.events += 1
        if data == "[DONE]":
            stream.finished = True
            return None
        obj = _stream_event(data)
        if "error" in obj:
            return f"stream error: {obj['error']}"[:200]
        stream.add(obj, time.perf_counter())
    return None


async def send_request(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str, spec: PromptSpec) -> RequestResult:
    path, body = _request_body(opts, model, spec)
    result = RequestResult(ok=False, requested_tokens=spec.output_len)
    stream = _Stream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
                return result
            result.error = await _read_stream(resp, stream)
    except (httpx.HTTPError, ValueError, OSError) as exc:  # ValueError: JSONDecodeError, malformed events
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter()
    if result.error is None:
        result.error = _stream_problem(stream)
    if result.error is not None:
        return result
    result.ok = True
    result.ttft_s = stream.chunk_times[0] - start
    result.e2e_s = end - start
    result.itl_s = metrics.inter_token_latencies(stream.chunk_times, stream.tokens_per_chunk())
    result.output_tokens = stream.output_tokens
    result.prompt_tokens = stream.prompt_tokens
    return result


def _stream_problem(stream: _Stream) -> str | None:
    if not stream.events:  # e.g. one JSON answer from a server that ignores "stream": true
        return "the response is not an event stream (no `data:` lines)"
    if not stream.chunk_times:
        return "no tokens streamed"
    if not stream.finished:  # the connection closed mid-answer: its numbers would flatter the server
        return f"stream ended after {len(stream.chunk_times)} chunk(s) without a finish_reason or [DONE]"
    return None


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
        output_tok_s=metrics.mean([v for r in good
                                   if not math.isnan(v := metrics.decode_tokens_per_second(r.output_tokens, r.ttft_s, r.e2e_s))]),
        aggregate_tok_s=metrics.tokens_per_second(out_tokens, duration_s),
        request_throughput=metrics.tokens_per_second(len(good), duration_s),
        output_tokens=out_tokens,
        mean_prompt_tokens=metrics.mean(prompt_counts),
        errors=tuple(sorted({r.error for r in results if r.error}))[:5],
        short_outputs=sum(r.short for r in results),
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


async def discover_model(client: httpx.AsyncClient) -> str:
    where = f"{client.base_url}/v1/models"
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ConfigError(f"could not list the server's models at {where} ({type(exc).__name__}: {exc}); "
                          "pass --model") from None
    if resp.status_code != 200:  # one line: httpx's own message adds a second with a link
        raise ConfigError(f"could not list the server's models at {where} (HTTP {resp.status_code}: "
                          f"{' '.join(resp.text.split())[:200]}); pass --model")
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
    async with httpx.AsyncClient(base_url=opts.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(opts.timeout_s)) as client:
        model = opts.model or await discover_model(client)
        await warm_up(client, opts, model, pool)
        levels, interrupted = [], False
        for i, conc in enumerate(opts.concurrency):
            specs = prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i, pool)
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
            "dataset": opts.dataset, "request_rate": opts.request_rate, "ignore_eos": opts.ignore_eos,
            "interrupted": interrupted,
            "levels": [lv.as_dict() for lv in levels]}


def _warn_if_prompts_repeat(opts: ServeBenchOptions, pool: list[PromptSpec] | None) -> None:
    most = max(opts.prompts_for(c) for c in opts.concurrency)
    if pool and most > len(pool):  # a prefix cache answers a repeated prompt without its prefill
        logger.warning("the dataset has %d prompts for up to %d requests a level: prompts repeat, and a server with a "
                       "prefix cache serves the repeats faster", len(pool), most)


async def warm_up(client: httpx.AsyncClient, opts: ServeBenchOptions, model: str,
                  pool: list[PromptSpec] | None) -> None:
    """The uncounted first requests. One that fails (a wrong --url or --model, a server that is down) would fail
    every measured request the same way, so the run stops here with its error."""
    # a seed no level uses: seed - 1 was -1 for the default 0, which Python's random takes as 1, so the second
    # level's first prompts were the warmup's, already in the prefix cache
    for spec in prompts_for_level(opts, opts.warmup, opts.seed + len(opts.concurrency), pool):
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
    if lv.get("short_outputs"):
        why = " (the server may not honour ignore_eos / min_tokens)" if ignore_eos else ""
        notes.append(f"{where}: {lv['short_outputs']} of {lv['ok']} requests stopped before their max_tokens{why}; "
                     "tok/s counts the tokens sent")
    if lv.get("interrupted"):
        notes.append(f"{where}: interrupted (Ctrl-C) after {lv['requests']} request(s); its numbers cover those only")
    return notes
