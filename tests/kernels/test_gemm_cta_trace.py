"""tools/gemm_cta_trace.py patches timestamps into a copy of the production GEMM kernel. The patch must
keep applying as gemm.py changes, and the copy must still compile for sm_90 (no GPU needed)."""

import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import gemm_cta_trace  # noqa: E402
import sass_loop_stats  # noqa: E402


def test_patch_anchors_fail_loudly():
    with pytest.raises(RuntimeError, match="anchor"):
        gemm_cta_trace.traced_source("def f():\n    pass\n")


def test_traced_kernel_compiles_for_sm90_with_timestamps():
    kernel = gemm_cta_trace.load_traced_kernel()
    consts = dict(HAS_BIAS=False, SWAP_AB=True, SPLIT=True, BM=16, BN=64, BK=256, GROUP_M=8, EVEN_K=True,
                  USE_ASM=True, PRECISE_ACC=True, DEPENDENT=True, PDL_PREFETCH=2, GLU=False, DEFER_SUM=False, ACT=0)
    signature = dict(sass_loop_stats.GEMM_SIG, trace_ptr="*i64", **{c: "constexpr" for c in consts})
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    ptx = compiled.asm["ptx"]
    assert ptx.count("%globaltimer") == 3 and "%smid" in ptx
    assert "wgmma.mma_async" in ptx  # still the production K loop


def test_step_summary_spans_and_gaps():
    import numpy as np

    def trace(starts, ends, sms):
        t = np.zeros((len(starts), gemm_cta_trace.FIELDS), dtype=np.int64)
        t[:, 0], t[:, 1], t[:, 2], t[:, 3] = starts, ends, ends, sms
        return t

    calls = [(64, 128, trace([1000, 1100], [5000, 6000], [0, 0])),  # two CTAs on SM 0
             (32, 128, trace([8000, 8000], [9000, 10000], [0, 1])),
             (64, 128, trace([12000], [13000], [3]))]
    lines = gemm_cta_trace.step_summary(calls)
    # spans from the first start: (0, 5), (7, 9), (11, 12) us; gaps 2 and 2
    assert "3 GEMMs: first start to last end 12.0 us; in GEMMs 8.0 us; between them 4.0 us" in lines[0]
    assert any(line.strip().startswith("64x128: 2 calls") and "CTAs per SM up to 2" in line
               and "gap before p50 2.00" in line for line in lines)
    assert any(line.strip().startswith("32x128: 1 calls") and "makespan p50 2.00" in line for line in lines)


def test_engine_mode_dry_run_on_cpu_says_nothing_was_captured():
    from tests.bench.test_bench_synthetic import TINY

    # the CPU runs the reference path and no graphs: the harness runs through and reports that plainly
    with pytest.raises(RuntimeError, match="no W4A8 GEMM was captured"):
        gemm_cta_trace.trace_engine("synthetic:llama-3.1-8b", context=8, steps=3, device="cpu",
                                    overrides={**TINY, "vocab_size": 512})
