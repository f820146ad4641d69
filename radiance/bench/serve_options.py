"""The options of `radiance bench serve`, apart from the load generator so that the CLI reads their defaults without
importing httpx and torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from radiance.bench.serve_backend import check_backend
from radiance.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"  # vLLM's bench serve default (--host 127.0.0.1 --port 8000)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names: time to first token, time per output token
# after the first (per request), inter-token latency, end-to-end latency
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # the per-request latencies vLLM's --goodput takes objectives for


@dataclass(frozen=True)
class ServeBenchOptions:
    url: str = DEFAULT_URL
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
    warmup: int = 1  # requests sent (and not counted) before the first level: radiance's line checks them; a vLLM
    # line sends vLLM's --num-warmups, copies of its first request, unchecked
    ready_check_s: float = 0.0  # vLLM's --ready-check-timeout-sec: the first request retried this long until it succeeds
    seed: int = 0
    progress: bool = True
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS  # the latencies whose percentiles are reported
    metric_percentiles: tuple[float, ...] = (50.0, 99.0)  # which percentiles (the table shows each)
    exact_input_len: bool = False  # random prompts fitted to input_len tokens with the server's /tokenize
    output_len_from_dataset: bool = False  # ShareGPT: each request's max_tokens is its reply's token count
    # (vLLM's sharegpt), counted with the server's /tokenize, and vLLM's length filter applied
    sharegpt_filter: bool = False  # ShareGPT with vLLM's --sharegpt-output-len: every request output_len tokens,
    # vLLM's length filter still applied to the prompts (4 to 1024 tokens, 2048 with output_len)
    goodput: tuple[tuple[str, float], ...] = ()  # vLLM's --goodput: (ttft / tpot / e2el, ms) service-level objectives
    disable_shuffle: bool = False  # vLLM's --disable-shuffle: a vLLM line keeps the dataset's order
    unlimited: bool = False  # a vLLM line without --max-concurrency: vLLM's max_concurrency is null, not the level's
    lora_modules: tuple[str, ...] = ()  # vLLM's --lora-modules: each measured request names one, drawn at random
    vllm_form: bool = False  # a `vllm bench serve` line (vllm_serve_args.is_vllm_command_line): vLLM's sampling of a
    # dataset (shuffled by the seed) and its timing (one inter-token gap per streamed chunk, whatever it carries)
    backend: str | None = None  # vLLM's --backend (openai, vllm, openai-chat): the result's "backend"; None: named
    # by the route (openai, or openai-chat for chat)
    save_detailed: bool = False  # vLLM's --save-detailed: the result keeps its per-request lists (input_lens, ttfts,
    # itls, generated_texts, errors, ...)
    custom_dataset: bool = False  # vLLM's --dataset-name custom: `dataset` is a JSONL file of {"prompt"} objects
    custom_output_len: int = 256  # vLLM's --custom-output-len: max_tokens of each custom request; -1: each line's
    # "output_tokens"
    skip_chat_template: bool = False  # vLLM's --skip-chat-template: custom prompts sent as written, not wrapped in
    # the model's chat template first

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
        if not self.ready_check_s >= 0:
            raise ConfigError(f"the ready check must be 0 or more seconds, got {self.ready_check_s}")
        if self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        unknown = [m for m in self.percentile_metrics if m not in PERCENTILE_METRICS]
        if not self.percentile_metrics or unknown:
            raise ConfigError(f"percentile metrics must be some of {','.join(PERCENTILE_METRICS)}, "
                              f"got {','.join(self.percentile_metrics) or 'none'}")
        if not self.metric_percentiles or not all(0 < q <= 100 for q in self.metric_percentiles):
            raise ConfigError(f"metric percentiles must be numbers in (0, 100], got {self.metric_percentiles}")
        bad = [f"{name}:{ms}" for name, ms in self.goodput if name not in GOODPUT_METRICS or not ms >= 0]
        if bad:  # vLLM's check_goodput_args
            raise ConfigError(f"goodput objectives are ttft, tpot or e2el with milliseconds >= 0, got {' '.join(bad)}")
        if self.backend is not None:
            check_backend(self.backend, self.endpoint)
        if self.custom_output_len != -1 and self.custom_output_len < 1:
            raise ConfigError(f"custom_output_len must be a positive number of tokens or -1 (each line's "
                              f"output_tokens), got {self.custom_output_len}")
        if self.custom_dataset and not self.dataset:
            raise ConfigError("the custom dataset needs its JSONL file (--dataset-path FILE.jsonl)")

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


SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeBenchOptions)}  # what the CLI flags show and use
