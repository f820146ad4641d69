"""The arithmetic behind every benchmark and evaluation number: percentiles, rates, perplexity
and KL divergence. Pure functions, no I/O, so each one can be checked against a hand-computed case."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).
    NaN for an empty sequence, so a level where every request failed still prints a row."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tokens_per_second(num_tokens: int | float, seconds: float) -> float:
    """Rate of `num_tokens` over `seconds`; NaN when no time elapsed (a rate cannot be measured)."""
    if seconds <= 0.0:
        return math.nan
    return num_tokens / seconds


def decode_tokens_per_second(itl_s: Sequence[float]) -> float:
    """A stream's generation speed after its first chunk, from its inter-token latencies (inter_token_latencies):
    the tokens that came after the first chunk over the time they took. The first chunk's tokens belong to the
    prefill; (tokens - 1) / (e2e - ttft) counted all but one of them as decoded, 36 tok/s for a 20 tok/s server
    that streams 5 tokens a chunk."""
    if not itl_s:
        return math.nan
    return tokens_per_second(len(itl_s), sum(itl_s))


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int] | None = None) -> list[float]:
    """Gaps between successive tokens (seconds), from the arrival times of the streamed chunks and the tokens
    each carried (default: one). A chunk of k tokens that came g after the previous one stands for k gaps of
    g / k: its tokens were made over that time and sent together. The first chunk's tokens come at the first
    token time, so they are no gaps."""
    counts = list(chunk_tokens) if chunk_tokens is not None else [1] * len(chunk_times)
    if len(counts) != len(chunk_times):
        raise ValueError(f"{len(chunk_times)} chunk times but {len(counts)} token counts")
    gaps = []
    for a, b, k in zip(chunk_times, chunk_times[1:], counts[1:]):
        gaps += [(b - a) / k] * k
    return gaps


def tokens_per_chunk(total_tokens: int, chunks: int) -> list[int]:
    """`total_tokens` spread over `chunks` as evenly as whole numbers allow, at least one each: the best guess of
    what each streamed chunk carried when the server reports only the total."""
    total = max(total_tokens, chunks)
    return [(i + 1) * total // chunks - i * total // chunks for i in range(chunks)]


def _second_buckets(starts: Sequence[float], latencies: Sequence[float]) -> tuple[float, int]:
    """vLLM's per-second buckets of a run: from the first request's send, ceil(span) + 1 of them."""
    origin = min(starts)
    span = max(s + lat for s, lat in zip(starts, latencies)) - origin
    return origin, math.ceil(span) + 1


def peak_output_tokens_per_second(starts: Sequence[float], ttfts: Sequence[float], itls: Sequence[Sequence[float]],
                                  latencies: Sequence[float]) -> float:
    """vLLM's "Peak output token throughput": the fullest one-second bucket of token arrival times, a request's
    tokens coming at send + TTFT and then after each of its inter-token latencies (one token per entry). 0.0
    without requests, as vLLM reports it."""
    if not starts:
        return 0.0
    origin, n = _second_buckets(starts, latencies)
    buckets = [0] * n
    for start, ttft, gaps in zip(starts, ttfts, itls):
        t = start + ttft
        for gap in (0.0, *gaps):
            t += gap
            if 0 <= (b := int(t - origin)) < n:
                buckets[b] += 1
    return float(max(buckets))


def peak_concurrent_requests(starts: Sequence[float], latencies: Sequence[float]) -> int:
    """vLLM's "Peak concurrent requests" (vllm/benchmarks/serve.py, calculate_metrics): the most requests in flight
    at any instant, each over [send, send + latency). A sweep over the sends (+1) and the ends (-1) sorted by time,
    an end before a send at the same instant (a request that ends as the next one starts is not concurrent with
    it), keeping the running maximum. vLLM counted every one-second bucket a request touched before (two requests
    that followed each other within a second were "2"); only its plot still does. 0 without requests."""
    events = sorted([(start, 1) for start in starts] + [(start + lat, -1) for start, lat in zip(starts, latencies)])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def good_requests(latencies_s: dict[str, Sequence[float]], slos_ms: dict[str, float]) -> int:
    """vLLM's goodput count (serve.py, calculate_metrics): the requests within every service-level objective given,
    each latency (seconds, a list a metric, one entry a request) at most its objective (milliseconds). vLLM takes a
    request's TPOT as 0 where it has one output token."""
    chosen = [(latencies_s[name], slo / 1000.0) for name, slo in slos_ms.items()]
    return sum(all(slo >= values[i] for values, slo in chosen) for i in range(len(chosen[0][0]))) if chosen else 0


def std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default, as vLLM's benchmark reports it); NaN when empty."""
    if not values:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def percentile_key(q: float) -> str:
    """'p99', 'p99.9': vLLM's names of a percentile in its result keys and summary lines."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


@dataclass(frozen=True)
class LatencySummary:
    p50: float
    p99: float
    mean: float
    std: float = math.nan
    percentiles: dict[str, float] | None = None  # the percentiles asked for, by percentile_key

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float] = (50.0, 99.0)) -> "LatencySummary":
        return cls(p50=percentile(values, 50), p99=percentile(values, 99), mean=mean(values), std=std(values),
                   percentiles={percentile_key(q): percentile(values, q) for q in percentiles})


# ------------------------------------------------------------------------ quality arithmetic


# positions scored at a time: the fp64 [rows, V] temporaries stay ~100 MB for a 49k vocabulary (all of a 2048-token
# chunk at once took `eval kl` to 7.3 GB, and an 8192-token one past this 24 GB machine)
SCORE_ROWS = 256


def _row_slices(n: int):
    return (slice(start, min(n, start + SCORE_ROWS)) for start in range(0, n, SCORE_ROWS))


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats) of `targets` [..., T] under `logits` [..., T, V], in fp64
    so sums over tens of thousands of tokens do not drift."""
    flat, ids = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1).long()
    out = torch.empty(ids.shape[0], dtype=torch.float64, device=logits.device)
    for rows in _row_slices(ids.shape[0]):
        out[rows] = -torch.log_softmax(flat[rows].double(), dim=-1).gather(-1, ids[rows]).squeeze(-1)
    return out.reshape(targets.shape)


def perplexity(total_nll: float, num_tokens: int) -> float:
    """exp(mean NLL); inf past float range (a broken variant's mean NLL over 709 nats must not end a comparison
    of several with an OverflowError)."""
    if num_tokens <= 0:
        raise ValueError("perplexity needs at least one token")
    try:
        return math.exp(total_nll / num_tokens)
    except OverflowError:
        return math.inf


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(ref || model) = sum_v p_ref (log p_ref - log p_model), in nats, fp64.
    Shapes [..., V] -> [...]. Zero-probability reference entries contribute nothing (0 log 0 = 0)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"KL needs logits of the same shape, got {tuple(ref_logits.shape)} and {tuple(logits.shape)}")
    ref_flat, flat = ref_logits.reshape(-1, ref_logits.shape[-1]), logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float64, device=logits.device)
    for rows in _row_slices(flat.shape[0]):
        ref_logp = torch.log_softmax(ref_flat[rows].double(), dim=-1)
        logp = torch.log_softmax(flat[rows].double(), dim=-1)
        ref_p = ref_logp.exp()
        terms = torch.where(ref_p > 0, ref_p * (ref_logp - logp), torch.zeros_like(ref_p))
        out[rows] = terms.sum(dim=-1)
    # clamp: rounding can leave a -1e-17 for identical distributions
    return out.clamp_min(0.0).reshape(logits.shape[:-1])


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per position, 1.0 where both distributions have the same argmax token."""
    return (ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)).double()
