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
                  USE_ASM=True, PRECISE_ACC=True, PDL_PREFETCH=2)
    signature = dict(sass_loop_stats.GEMM_SIG, trace_ptr="*i64", **{c: "constexpr" for c in consts})
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    ptx = compiled.asm["ptx"]
    assert ptx.count("%globaltimer") == 3 and "%smid" in ptx
    assert "wgmma.mma_async" in ptx  # still the production K loop
