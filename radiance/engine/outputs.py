"""What the engine hands back per step (see docs/ARCHITECTURE.md), and what LLM.generate returns."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + the tokens more likely than it (vLLM's rank)


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's Logprob: one token's entry in what LLM.generate returns as logprobs (per output token
    {token id: Logprob} for the token and its top alternatives) and prompt_logprobs (the same per prompt token,
    None for the first)."""

    logprob: float
    # 1-based, 1 + the tokens more likely; None for a sampled token ranked below every alternative returned
    # (the engine ranks only scored prompt tokens, so there the alternatives cannot tell)
    rank: int | None = None
    decoded_token: str | None = None  # the token's text decoded alone; None with detokenize=False or no tokenizer


# vLLM's names of the two shapes
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class RequestTimes:
    """When the engine first scheduled a request and when its first and latest tokens came out of a step, on
    time.monotonic() (the clock the server's RequestTimer reads); None until then. Frozen: a step replaces it, so
    an output already handed to another thread never changes."""

    first_scheduled: float | None = None  # a preempted request, scheduled again, keeps its first
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class StepOutput:
    """One request's state after an engine step (LLMEngine.step, AsyncLLMEngine.generate): cumulative text and
    tokens, the finish reason once it ended."""

    request_id: str
    prompt_token_ids: list[int]
    text: str                    # cumulative
    token_ids: list[int]         # cumulative
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None    # None | "stop" | "length" | "abort"
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first
    cumulative_logprob: float | None = None  # the sum of the output tokens' logprobs; None without logprobs
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)
    times: RequestTimes | None = None  # for the server's queue / prefill / decode metrics


@dataclass
class CompletionOutput:
    """One choice of an LLM.generate / LLM.chat result (vLLM's CompletionOutput, under the same name)."""

    # vLLM's positional order (CompletionOutput(0, "text", ids, -1.5, None, "stop") reads as in vLLM)
    index: int
    text: str  # "" with SamplingParams(detokenize=False)
    token_ids: list[int]
    cumulative_logprob: float | None = None  # the sum of the output tokens' logprobs; None without logprobs
    logprobs: SampleLogprobs | None = None  # SamplingParams.logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)

    def finished(self) -> bool:
        """vLLM's method: whether the output has ended (always, in what LLM.generate returns)."""
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """One prompt's result of LLM.generate / LLM.chat: vLLM's RequestOutput, which `radiance.RequestOutput` and
    `radiance.engine.RequestOutput` name (the engine's own per-step output is StepOutput)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs
    request_id: str = ""  # "0", "1", ... per prompt over the LLM's life, as vLLM numbers them
    finished: bool = True  # LLM.generate returns finished requests only
    # when the engine first scheduled it and its first and last tokens came (time.monotonic()); of the choice
    # that finished last when n > 1
    metrics: RequestTimes | None = None


# vLLM's buckets of iteration_tokens_total
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# the server's time_per_output_token buckets (vLLM's start at 10 ms, above most decode steps on a GPU)
INTER_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class HistogramCounts:
    """A histogram's state: the observations at most each bound (not cumulative), then those above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1
    sum: float


class StepHistogram:
    """A distribution the engine observes per step (tokens per step, gaps between a request's tokens), kept as
    bucket counts for /metrics: the engine needs no Prometheus, and nothing is lost between scrapes. The lock makes
    a snapshot (read from the server's thread) consistent with the step thread's observations."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values) -> None:
        """Several observations under one lock (a step's gaps, one per sequence)."""
        # a value equal to a bound is in its bucket (le)
        buckets = [bisect.bisect_left(self.bounds, value) for value in values]
        with self._lock:
            for bucket in buckets:
                self._counts[bucket] += 1
            self._sum += sum(values)

    def snapshot(self) -> HistogramCounts:
        with self._lock:
            return HistogramCounts(self.bounds, tuple(self._counts), self._sum)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    draft_tokens_total: int = 0  # speculative (n-gram) tokens proposed
    accepted_draft_tokens_total: int = 0  # ... and kept
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits_total: int = 0  # ... and found there
    iteration_tokens: HistogramCounts | None = None  # tokens each step computed (prompt chunks, decodes, drafts)
    inter_token_latency: HistogramCounts | None = None  # seconds between a request's steps that gave it tokens
    cache_config: dict[str, str] = field(default_factory=dict)  # the KV cache's settings, as vLLM's labels name them
    max_lora: int | None = None  # LoRA on: adapters per step at most (None: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()  # the adapters of running requests, as of the last step
    waiting_lora_adapters: tuple[str, ...] = ()  # ... and of waiting ones
