"""Per-request generation settings (the vLLM shape users know)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1              # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None      # per-request generator: same seed, same prompt -> same tokens
    stop: tuple[str, ...] | str = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        def check(cond, msg):
            if not cond:
                raise ValueError(msg)

        check(self.n >= 1, f"n must be at least 1, got {self.n}")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or non-negative, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
