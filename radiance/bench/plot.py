"""`--plot FILE.png` for the bench commands: one line per configuration (matplotlib, optional
dependency: `pip install radiance[plot]`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from radiance.bench.report import check_output_path
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'radiance[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def check_plot_path(path: str) -> None:
    """Everything --plot needs, checked before the benchmark runs: a .png name in a writable directory and
    matplotlib (a failure after a long run would leave only the printed numbers)."""
    _check_png(path)
    check_output_path(path, "--plot")
    _pyplot()


def _check_png(path: str) -> None:
    if not str(path).lower().endswith(".png"):
        raise ConfigError(f"--plot expects a .png file name, got {path!r}")


def plot_lines(path: str, series: Mapping[str, Sequence[tuple[float, float]]], title: str, xlabel: str,
               ylabel: str, log_x: bool = False) -> None:
    """Write a PNG with one line per entry of `series` ({label: [(x, y), ...]}); NaN points are skipped."""
    _check_png(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        pts = [(x, y) for x, y in points if y is not None and not math.isnan(y)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    _label_axis(ax, title, xlabel, ylabel, log_x)
    _save(plt, fig, path)


def _label_axis(ax, title: str, xlabel: str, ylabel: str, log_x: bool) -> None:
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:  # the directory went away or is not writable: the user's to fix, one line
        raise ConfigError(f"cannot write --plot {path}: {exc}") from None
    finally:
        plt.close(fig)
    logger.info("wrote %s", path)


def serve_series(results: Sequence[Mapping]) -> dict[str, list[tuple[float, float]]]:
    """{label: [(concurrency, aggregate output tok/s)]}, one entry per `bench serve` result. A level cut short by
    Ctrl-C is left out: its rate counts only the requests that finished before it."""
    series = {}
    for res in results:
        try:
            label = res.get("label") or f"{res['model']} ({res['url']})"
            series[label] = [(lv["concurrency"], lv["aggregate_tok_s"]) for lv in res["levels"]
                             if not lv.get("interrupted")]
        except (AttributeError, KeyError, TypeError):  # an earlier file that is some other JSON
            raise ConfigError("not a `radiance bench serve --json` result (expected 'model', 'url' and 'levels' "
                              "with 'concurrency' and 'aggregate_tok_s')") from None
    return series


def plot_serve_results(path: str, results: Sequence[Mapping]) -> None:
    """Aggregate output tok/s against concurrency, one line per `bench serve` result."""
    plot_lines(path, serve_series(results), "bench serve: aggregate output throughput", "concurrent requests",
               "output tok/s", log_x=True)


def _keyed(row: Mapping, prefix: str) -> list[tuple[int, float]]:
    """[(x, value)] of a `bench engine` row's keys like 'agg_tok_s@64', sorted by x."""
    out = []
    for key, value in row.items():
        if key.startswith(prefix + "@") and isinstance(value, (int, float)):
            out.append((int(key.split("@", 1)[1]), float(value)))
    return sorted(out)


def plot_engine_rows(path: str, rows: Sequence[Mapping]) -> None:
    """`bench engine` rows -> two panels: output tok/s against concurrency (batch 1 = the decode rate at
    the shortest context) and prefill tok/s against prompt length; one line per variant."""
    _check_png(path)
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for row in rows:
        if "error" in row:
            continue
        label = str(row.get("variant"))
        decode = _keyed(row, "decode_ms")
        conc = _keyed(row, "agg_tok_s")
        if decode and decode[0][1] > 0:
            conc = [(1, 1e3 / decode[0][1])] + [p for p in conc if p[0] != 1]
        if conc:
            left.plot([p[0] for p in conc], [p[1] for p in conc], marker="o", label=label)
        prefill = _keyed(row, "prefill_tok_s")
        if prefill:
            right.plot([p[0] for p in prefill], [p[1] for p in prefill], marker="o", label=label)
    for ax, title, xlabel, ylabel in ((left, "decode throughput", "concurrent sequences", "output tok/s"),
                                      (right, "prefill", "prompt tokens", "prefill tok/s")):
        _label_axis(ax, title, xlabel, ylabel, log_x=True)
    _save(plt, fig, path)
