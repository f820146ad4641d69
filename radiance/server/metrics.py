"""Prometheus metrics of the server (`/metrics`).

Engine state (running / waiting requests, KV usage, token and preemption totals) is read from
`engine.stats()` at scrape time, so the numbers are never stale; latencies are observed per request
by the serving code. Each app has its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# no `*_created` timestamp series beside each counter and histogram (vLLM turns them off too): they doubled
# the families a scraper sees and no dashboard reads them. The switch is prometheus_client's, process-wide.
disable_created_metrics()

PREFIX = "radiance_"  # the names' default start; ServerConfig.metrics_prefix "vllm:" gives vLLM's names
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# vLLM v1's finish reasons (FINISH_REASON_STRINGS) that a request here can end with
FINISHED_REASONS = ("stop", "length", "abort", "error")
ABORT, ERROR = "abort", "error"

_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class ServedRequest:
    """The HTTP request the current task serves (set by the API middleware for the request's whole life, streams
    included): its id (the client's X-Request-Id or a new one: sent back in that header, tagged on log lines) and
    the status of an error a stream reported in-band after its 200 went out (errors.sse_error), which
    request_errors counts as it counts an error answer."""

    request_id: str
    stream_error_status: int | None = None


current_request: ContextVar[ServedRequest | None] = ContextVar("radiance_current_request", default=None)


class _EngineCollector:
    """Reads EngineStats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], object | None], model_name: Callable[[], str], prefix: str):
        self._stats = stats
        self._model_name = model_name
        self._prefix = prefix

    def collect(self):
        stats = self._stats()
        if stats is None:  # still loading
            return
        label = [self._model_name()]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(self._prefix + name, doc, labels=["model_name"])
            g.add_metric(label, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(self._prefix + name, doc, labels=["model_name"])
            c.add_metric(label, float(value))
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", stats.kv_cache_usage)
        yield counter("num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks.", stats.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens processed (an n>1 request's once per choice).",
                      stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("spec_decode_num_draft_tokens", "Speculative (n-gram) draft tokens proposed.",
                      stats.draft_tokens_total)
        yield counter("spec_decode_num_accepted_tokens", "Speculative draft tokens kept.",
                      stats.accepted_draft_tokens_total)
        # vLLM's names: a dashboard's hit rate is hits / queries
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries_total)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits_total)


class ServerMetrics:
    """Every series carries the served model's name (`model_name`, as vLLM's), read when it is recorded: the
    name can change once the model loads (the embedded model's, a checkpoint's own). Names start with `prefix`:
    with "vllm:" they are vLLM's (vllm:num_requests_waiting, vllm:time_to_first_token_seconds, ...), which its
    dashboards and autoscaling rules read."""

    def __init__(self, stats: Callable[[], object | None], model_name: Callable[[], str], prefix: str = PREFIX):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name, prefix))
        self._time_to_first_token = Histogram(
            prefix + "time_to_first_token_seconds", "Time from request arrival to its first output token.",
            ["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self._time_per_output_token = Histogram(
            prefix + "time_per_output_token_seconds", "Mean time between output tokens of a request, after the first.",
            ["model_name"], registry=self.registry, buckets=_TOKEN_BUCKETS)
        self._e2e_latency = Histogram(
            prefix + "e2e_request_latency_seconds",
            "Time from request arrival to its end (last output token, abort or error).",
            ["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self._request_success = Counter(
            prefix + "request_success", "Ended engine requests by finish reason (abort: client gone or server "
            "stopping; error: the engine failed).", ["model_name", "finished_reason"], registry=self.registry)
        self._http_errors = Counter(
            prefix + "request_errors", "Requests answered with an error, by HTTP status.", ["model_name", "status"],
            registry=self.registry)

    def first_token(self, seconds: float) -> None:
        self._time_to_first_token.labels(model_name=self.model_name()).observe(seconds)

    def time_per_output_token(self, seconds: float) -> None:
        self._time_per_output_token.labels(model_name=self.model_name()).observe(seconds)

    def request_ended(self, seconds: float, reason: str) -> None:
        self._e2e_latency.labels(model_name=self.model_name()).observe(seconds)
        self._request_success.labels(model_name=self.model_name(), finished_reason=reason).inc()

    def http_error(self, status: int | str) -> None:
        self._http_errors.labels(model_name=self.model_name(), status=str(status)).inc()

    def render(self) -> bytes:
        name = self.model_name()
        for reason in FINISHED_REASONS:  # every reason shows from the start (0), as vLLM's do
            self._request_success.labels(model_name=name, finished_reason=reason)
        for histogram in (self._time_to_first_token, self._time_per_output_token, self._e2e_latency):
            histogram.labels(model_name=name)  # an empty histogram shows too, as it did before labels
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one engine request (one choice), which ends in the metrics exactly once: finished
    by the engine, aborted, failed, or (refused before it started) not at all."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None):
        self.metrics = metrics
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.first_token: float | None = None
        self.num_tokens = 0
        self.ended = False

    def tokens(self, total: int) -> None:
        if total > 0 and self.first_token is None:
            self.first_token = time.monotonic()
            self.metrics.first_token(self.first_token - self.arrival)
        self.num_tokens = total

    def discard(self) -> None:
        """The engine refused the request up front (a 400): it never ran, so it ends in no metric."""
        self.ended = True

    def finished(self, reason: str | None) -> None:
        """Records the end (a later call is ignored); e2e and TPOT cover aborted and failed requests too."""
        if self.ended:
            return
        self.ended = True
        end = time.monotonic()
        if self.first_token is not None and self.num_tokens > 1:
            self.metrics.time_per_output_token((end - self.first_token) / (self.num_tokens - 1))
        self.metrics.request_ended(end - self.arrival, reason or "unknown")
