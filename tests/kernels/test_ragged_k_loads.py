"""A K that is no multiple of the K tile (gpt-oss's 2880) masks the last tile's loads. The masks are built
constant over each 128-k word group and each 32-column activation block (convert.live_words, gemm.live_k), so the
masked loads stay the 16-byte copies of the even case; per-element masks split them into 4-byte ones (68 of
the 76 copies of the dense and grouped decode tiles; gpt-oss-20b's decode step ran 2.47 instead of 2.14 ms).
Compiled for sm_90 with no GPU, with the 16-byte alignment Triton's launcher specializes for our shapes."""

import re
from collections import Counter

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radiance.kernels._triton import convert, gemm, moe_gemm
from tests.kernels.test_moe_compile import SIGNATURE as MOE_SIGNATURE

GEMM_SIGNATURE = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*i32", shift_ptr="*i32", ws_ptr="*fp32",
                      bias_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32", amax_ptr="*i32",
                      M="i32", N="i32", K="i32", stride_xm="i32", stride_om="i32", k_tiles_per_split="i32",
                      splits="i32")
DECODE_TILE = dict(BM=16, BN=64, BK=256, SWAP_AB=True, USE_ASM=True, PRECISE_ACC=True, HAS_BIAS=False)


def sm90_ptx(kernel, signature: dict, consts: dict, num_stages: int = 4) -> str:
    divisible = [a for a, t in signature.items() if t.startswith("*")]
    divisible += [a for a in ("N", "K", "stride_xm", "stride_om") if a in signature]
    src = ASTSource(fn=kernel, signature=dict(signature, **{c: "constexpr" for c in consts}),
                    constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()},
                    attrs={(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible})
    options = {"num_warps": 4, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def async_copy_sizes(kernel, signature: dict, consts: dict) -> Counter:
    """Bytes per cp.async in the PTX of `kernel` compiled for sm_90 -> how many."""
    ptx = sm90_ptx(kernel, signature, consts)
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global[\w.:]* \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)
    return Counter(int(size, 16) for size in copies)


KERNELS = {
    "dense": (gemm.w4a8_gemm_kernel, GEMM_SIGNATURE,
              dict(DECODE_TILE, SPLIT=True, GROUP_M=8, DEPENDENT=True, PDL_PREFETCH=1, GLU=False, DEFER_SUM=False,
                   ACT=0)),
    "grouped": (moe_gemm.w4a8_moe_gemm_kernel, MOE_SIGNATURE,
                dict(DECODE_TILE, GLU=True, ACT=1, ALPHA=1.702, LIMIT=7.0, PERSISTENT=False, PDL=True)),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_ragged_k_keeps_16_byte_copies(name):
    kernel, signature, consts = KERNELS[name]
    even = async_copy_sizes(kernel, signature, dict(consts, EVEN_K=True))
    ragged = async_copy_sizes(kernel, signature, dict(consts, EVEN_K=False))
    assert even[16] > 0
    assert ragged == even, f"{name}: cp.async sizes {dict(ragged)} with a ragged K, {dict(even)} without"


def test_expand_kernel_loads_words_in_16_byte_vectors():
    """The large-M paths' expansion to e4m3 (convert.expand_weight_kernel) masks every tile's words by group:
    its 64 x 32 words (16 per thread) come in four 16-byte loads, not sixteen 4-byte ones."""
    signature = dict(w_ptr="*i32", shift_ptr="*i8", out_ptr="*fp8e4nv", N="i32", K="i32")
    ptx = sm90_ptx(convert.expand_weight_kernel, signature, dict(BN=64, BK=256, USE_ASM=True), num_stages=1)
    loads = Counter(re.findall(r"ld\.global[\w.:]*", ptx))
    assert loads["ld.global.v4.b32"] == 4 and loads["ld.global.b32"] <= 1, dict(loads)  # (the b32: the shifts)
