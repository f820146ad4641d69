import builtins
import json

import pytest

from radiance.bench import plot
from radiance.bench.cli import _with_engine_plot
from radiance.errors import ConfigError

ROWS = [{"variant": "none", "decode_ms@128": 20.0, "prefill_tok_s@1024": 9000.0, "prefill_tok_s@8192": 8000.0,
         "agg_tok_s@16": 500.0, "agg_tok_s@64": 1500.0},
        {"variant": "mxfp4", "decode_ms@128": 5.0, "prefill_tok_s@1024": 12000.0, "agg_tok_s@64": 2500.0},
        {"variant": "hf", "error": "RuntimeError: out of memory"}]


def test_engine_rows_are_read_by_key():
    assert plot._keyed(ROWS[0], "agg_tok_s") == [(16, 500.0), (64, 1500.0)]
    assert plot._keyed(ROWS[0], "prefill_tok_s") == [(1024, 9000.0), (8192, 8000.0)]
    assert plot._keyed(ROWS[2], "agg_tok_s") == []


def test_engine_plot_through_the_cli_wrapper(tmp_path):
    seen = {}

    def fake_engine_bench(args):
        seen["json"] = args.json
        with open(args.json, "w") as fh:
            json.dump(ROWS, fh)
        return 0

    class Args:
        json = None
        plot = str(tmp_path / "engine.png")

    assert _with_engine_plot(fake_engine_bench)(Args()) == 0
    assert seen["json"]  # the wrapper asked the bench for its rows
    assert (tmp_path / "engine.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=".png"):
        plot.plot_lines(str(tmp_path / "x.jpg"), {"a": [(1, 2)]}, "t", "x", "y")
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match="pip install"):
        plot.plot_lines(str(tmp_path / "x.png"), {"a": [(1, 2)]}, "t", "x", "y")


def test_unwritable_plot_path_is_a_config_error(tmp_path):
    """savefig's FileNotFoundError / PermissionError was a raw traceback after the whole benchmark."""
    target = str(tmp_path / "gone" / "x.png")
    with pytest.raises(ConfigError, match="cannot write"):
        plot.plot_lines(target, {"a": [(1, 2)]}, "t", "x", "y")
    with pytest.raises(ConfigError, match="does not exist"):
        plot.check_plot_path(target)
    with pytest.raises(ConfigError, match="not a `radiance bench serve --json` result"):
        plot.serve_series([{"model": "m", "url": "u", "levels": [{"concurrency": 1}]}])


def test_serve_series_leaves_out_a_level_cut_short_by_ctrl_c():
    """An interrupted level's tok/s counts only the requests that finished: drawn, it would look like a collapse."""
    result = {"model": "m", "url": "u", "levels": [
        {"concurrency": 1, "aggregate_tok_s": 50.0, "interrupted": False},
        {"concurrency": 8, "aggregate_tok_s": 3.0, "interrupted": True}]}
    assert plot.serve_series([result]) == {"m (u)": [(1, 50.0)]}
    older = {"model": "m", "url": "u", "label": "old", "levels": [{"concurrency": 2, "aggregate_tok_s": 9.0}]}
    assert plot.serve_series([older]) == {"old": [(2, 9.0)]}  # results written before the field existed
