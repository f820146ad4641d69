"""Terminal tables and JSON for benchmark results: one place that decides how numbers print."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from radiance.bench.metrics import percentile_key
from radiance.errors import ConfigError


def format_number(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: Sequence[int] | None = None) -> str:
    """Right-aligned plain-text table; `digits` gives the decimals of each float column."""
    digits = list(digits) if digits is not None else [1] * len(headers)
    cells = [[format_number(v, digits[i]) for i, v in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null so any JSON reader accepts the output."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(obj: Any) -> str:
    return json.dumps(_json_safe(obj), indent=2)


def check_output_path(path: str, flag: str) -> None:
    """A file a command writes at its end: checked before the run, so a typo costs an error line, not the run."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{flag} {path} is a directory, expected a file name")
    if not file.parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {file.parent} does not exist")
    if not os.access(file.parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {file.parent} is not writable")


# ------------------------------------------------------------------ `radiance bench serve`'s result and table


def vllm_metrics(lv: dict, percentile_metrics=("ttft", "tpot", "itl"), percentiles=(99.0,)) -> dict:
    """One level's numbers under the keys of vLLM's `bench serve` result file (mean/median/std/pNN in ms of the
    chosen metrics, as vLLM writes them)."""
    out = {"duration": lv["duration_s"], "completed": lv["ok"], "failed": lv["failed"],
           "max_concurrency": lv["concurrency"], "total_input_tokens": lv.get("input_tokens", 0),
           "total_output_tokens": lv["output_tokens"], "request_throughput": lv["request_throughput"],
           "request_goodput": lv.get("request_goodput"),  # null without --goodput, as vLLM writes it
           "output_throughput": lv["aggregate_tok_s"], "total_token_throughput": lv.get("total_tok_s", math.nan),
           "max_output_tokens_per_s": lv.get("peak_output_tok_s", math.nan),
           "max_concurrent_requests": lv.get("peak_concurrency")}
    for name in percentile_metrics:
        summary, scale = _metric_summary(lv, name)
        if summary is None:
            continue
        pcts = summary.get("percentiles") or {}
        out[f"mean_{name}_ms"] = summary["mean"] * scale
        out[f"median_{name}_ms"] = summary["p50"] * scale
        out[f"std_{name}_ms"] = summary.get("std", math.nan) * scale
        for q in percentiles:
            key = percentile_key(q)
            value = pcts.get(key, summary.get(key, math.nan))
            out[f"{key}_{name}_ms"] = value * scale if value is not None else math.nan
    return out


def vllm_run_keys(backend: str, model: str) -> dict:
    """The keys of vLLM's result file about the run: its --backend (serve_backend.result_backend: the route's when
    none was given), its tokenizer the server's (the model's, vLLM's default), Poisson arrivals (burstiness 1) and
    no label (--label sets one)."""
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
            "label": None, "tokenizer_id": model, "burstiness": 1.0}


def _metric_summary(lv: dict, name: str) -> tuple[dict | None, float]:
    """The level's summary of a vLLM metric name and the factor to milliseconds (E2E is kept in seconds)."""
    key, scale = {"ttft": ("ttft_ms", 1.0), "tpot": ("tpot_ms", 1.0), "itl": ("itl_ms", 1.0),
                  "e2el": ("e2e_s", 1e3)}[name]
    return lv.get(key), scale


_COLUMN = {"ttft": ("TTFT", "ms", "ttft_ms", 1), "tpot": ("TPOT", "ms", "tpot_ms", 2),
           "itl": ("ITL", "ms", "itl_ms", 2), "e2el": ("E2E", "s", "e2e_s", 2)}


def serve_table(result: dict) -> str:
    """One row a level: the chosen percentiles of the chosen latencies (--percentile-metrics, --metric-percentiles),
    then the rates; a run of one level adds vLLM's summary block, to compare line by line."""
    names = result.get("percentile_metrics") or ("ttft", "itl", "e2el")  # results written before the option
    qs = result.get("metric_percentiles") or (50.0, 99.0)
    cols = [(name, percentile_key(q)) for name in names for q in qs]
    headers = ("conc", "ok", "failed", *(f"{_COLUMN[n][0]} {k} {_COLUMN[n][1]}" for n, k in cols),
               "out tok/s", "agg tok/s")
    rows = [(lv["concurrency"], lv["ok"], lv["failed"], *(_level_percentile(lv, n, k) for n, k in cols),
             lv["output_tok_s"], lv["aggregate_tok_s"]) for lv in result["levels"]]
    lines = [f"{result['model']} at {result['url']} ({result['endpoint']})",
             format_table(headers, rows, digits=(0, 0, 0, *(_COLUMN[n][3] for n, _ in cols), 1, 1))]
    for lv in result["levels"]:
        lines += _level_notes(lv, result.get("ignore_eos", True))
    if len(result["levels"]) == 1 and "vllm" in result["levels"][0]:
        lines += ["", vllm_summary(result["levels"][0]["vllm"], names, qs, result.get("request_rate"))]
    return "\n".join(lines)


def _level_percentile(lv: dict, name: str, key: str) -> float:
    summary = lv.get(_COLUMN[name][2]) or {}
    value = (summary.get("percentiles") or {}).get(key, summary.get(key))
    return math.nan if value is None else value


def vllm_summary(v: dict, names, qs, request_rate=None) -> str:
    """vLLM's "Serving Benchmark Result" block, its lines and labels, from vllm_metrics' keys."""
    def line(label, value, fmt=".2f"):
        text = "nan" if isinstance(value, float) and math.isnan(value) else format(value, fmt)
        return f"{label:<40} {text:<10}".rstrip()

    out = [" Serving Benchmark Result ".center(50, "="), line("Successful requests:", v["completed"], "d"),
           line("Failed requests:", v["failed"], "d")]
    if v["max_concurrency"] is not None:  # vLLM prints it only where --max-concurrency was given
        out.append(line("Maximum request concurrency:", v["max_concurrency"], "d"))
    if request_rate not in (None, "inf"):
        out.append(line("Request rate configured (RPS):", request_rate))
    out += [line("Benchmark duration (s):", v["duration"]), line("Total input tokens:", v["total_input_tokens"], "d"),
            line("Total generated tokens:", v["total_output_tokens"], "d"),
            line("Request throughput (req/s):", v["request_throughput"])]
    if v.get("request_goodput") is not None:
        out.append(line("Request goodput (req/s):", v["request_goodput"]))
    out.append(line("Output token throughput (tok/s):", v["output_throughput"]))
    if v.get("max_concurrent_requests") is not None:  # results written before the peaks have none
        out += [line("Peak output token throughput (tok/s):", v["max_output_tokens_per_s"]),
                line("Peak concurrent requests:", v["max_concurrent_requests"])]  # vLLM prints it as 8.00
    out.append(line("Total token throughput (tok/s):", v["total_token_throughput"]))
    headers = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
               "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in names:
        if f"mean_{name}_ms" not in v:
            continue
        label = name.upper()
        out += [headers[name].center(50, "-"), line(f"Mean {label} (ms):", v[f"mean_{name}_ms"]),
                line(f"Median {label} (ms):", v[f"median_{name}_ms"])]
        out += [line(f"{key.upper()} {label} (ms):", v[f"{key}_{name}_ms"])
                for key in (percentile_key(q) for q in qs)]
    out.append("=" * 50)
    return "\n".join(out)


def _level_notes(lv: dict, ignore_eos: bool) -> list[str]:
    where = f"concurrency {lv['concurrency']}"
    notes = [f"{where}: error: {err}" for err in lv["errors"]]
    if lv.get("counted_from_text"):
        tokens, chunks = lv["text_tokens"], lv["text_chunks"]
        differs = f" (counted as streamed chunks they were {chunks})" if tokens != chunks else ""
        notes.append(f"{where}: {lv['counted_from_text']} of {lv['ok']} requests came without usage: their "
                     f"{tokens} output tokens are their text's by the server's /tokenize, as vLLM counts them{differs}")
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
