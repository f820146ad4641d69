"""tools/moe_gemm_bench.py: the expert shapes it reads from the synthetic configs, and the harness end to end (a
CPU dry run under the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when Triton is imported)."""

import re
import sys

import pytest

from tests.bench.tool_run import ROOT, run_tool

sys.path.insert(0, str(ROOT / "tools"))
import moe_gemm_bench  # noqa: E402


def test_model_shapes_are_the_published_ones():
    gpt_oss = moe_gemm_bench.model_shapes("synthetic:gpt-oss-20b")
    assert (gpt_oss.experts, gpt_oss.top_k, gpt_oss.hidden, gpt_oss.intermediate, gpt_oss.biased) == \
        (32, 4, 2880, 2880, True)
    assert gpt_oss.activation.kind == "swiglu_oai"
    qwen = moe_gemm_bench.model_shapes("synthetic:qwen3-30b-a3b")
    assert (qwen.experts, qwen.top_k, qwen.hidden, qwen.intermediate, qwen.biased) == (128, 8, 2048, 768, False)
    with pytest.raises(SystemExit, match="no mixture-of-experts"):
        moe_gemm_bench.model_shapes("synthetic:llama-3.1-8b")


def test_shapes_without_a_synthetic_config():
    shapes = moe_gemm_bench.parse_shapes("128,8,4096,1536")  # Qwen3-235B-A22B
    assert (shapes.experts, shapes.top_k, shapes.hidden, shapes.intermediate, shapes.biased) == (128, 8, 4096, 1536,
                                                                                                False)
    assert shapes.activation.kind == "silu"
    for bad in ("128,8,4096", "128,8,4096,x", "4,8,64,32", "0,1,64,32"):
        with pytest.raises(SystemExit, match="--shapes"):
            moe_gemm_bench.parse_shapes(bad)


@pytest.mark.parametrize("model", ["synthetic:gpt-oss-20b", "synthetic:qwen3-30b-a3b"])
def test_dry_run_checks_the_grouped_path(model):
    proc = run_tool("moe_gemm_bench.py", "--model", model, "--tokens", "1", "3", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"(?:W4A8|bf16 grouped) ([0-9.e+-]+)", proc.stdout)]
    assert len(errors) == 4 and all(e <= 2e-3 for e in errors), proc.stdout


def test_dry_run_checks_every_forced_tile():
    proc = run_tool("moe_gemm_bench.py", "--model", "synthetic:qwen3-30b-a3b", "--tokens", "3", "--block-m", "16", "64",
                    "128", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tiles = re.findall(r"(\d+)-slot tiles: rel err grouped W4A8 ([0-9.e+-]+)", proc.stdout)
    assert [t for t, _ in tiles] == ["16", "64", "128"] and all(float(e) <= 2e-3 for _, e in tiles), proc.stdout


def test_dry_run_with_shapes():
    proc = run_tool("moe_gemm_bench.py", "--shapes", "128,8,4096,1536", "--tokens", "2", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"experts 128,8,4096,1536 toy, 2 tokens: rel err grouped W4A8 ([0-9.e+-]+)", proc.stdout), proc.stdout


def test_dry_run_needs_the_interpreter():
    proc = run_tool("moe_gemm_bench.py", "--dry-run", interpret=False)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
