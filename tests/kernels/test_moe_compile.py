"""The grouped W4A8 GEMM's production tilings (moe.MOE_CONFIGS) compile for sm_90 with no GPU: fp8 wgmma in the
PTX, and the persistent tiling's tile loop (a flattened `tl.range`) survives the pipeliner. CI has no GPU; the
compiled kernels run in test_gpu_moe.py on the H200."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radiance.kernels._triton import moe_gemm
from radiance.kernels.moe import MOE_CONFIGS

SIGNATURE = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*i32", shift_ptr="*i32", ws_ptr="*fp32", bias_ptr="*fp32",
                 out_ptr="*bf16", amax_ptr="*i32", pairs_ptr="*i32", tile_expert_ptr="*i32", group_ends_ptr="*i32",
                 num_experts="i32", num_pairs="i32", rows_div="i32", N="i32", K="i32", stride_xm="i32",
                 stride_om="i32", num_programs="i32")


def compile_for_sm90(block_m: int, glu: bool):
    cfg = MOE_CONFIGS[block_m]
    kernel = moe_gemm.w4a8_moe_gemm_kernel
    consts = dict(SWAP_AB=cfg.swap_ab, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, EVEN_K=True, USE_ASM=True,
                  PRECISE_ACC=cfg.precise_acc, HAS_BIAS=False, GLU=glu, ACT=0, ALPHA=None, LIMIT=None,
                  PERSISTENT=cfg.persistent, PDL=True)
    signature = dict(SIGNATURE, **{c: "constexpr" for c in consts})
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("block_m", sorted(MOE_CONFIGS))
def test_production_tilings_compile_to_fp8_wgmma(block_m, glu):
    ptx = compile_for_sm90(block_m, glu).asm["ptx"]
    assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx
    assert "griddepcontrol.wait" in ptx  # launched as a programmatic dependent on sm_90 (moe.w4a8_moe_gemm)
    if MOE_CONFIGS[block_m].persistent:
        assert "cp.async" in ptx  # the weight / activation tiles still stream through the software pipeline
