"""What the engine hands back per step (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + the tokens more likely than it (scored prompt tokens; None for sampled ones)


@dataclass
class RequestOutput:
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
