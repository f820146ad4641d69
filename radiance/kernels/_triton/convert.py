"""e2m1 -> e4m3 expansion of MXFP4 tiles, with the block shift folded into the exponent.

Input: kernel words int32 [BN, NB, 4] (prepare.pack_kernel_words: word q of a block holds k 4q..4q+3
and 16+4q..16+4q+3) and int32 shifts [BN, NB]. Output: e4m3 [BN, NB * 32] in natural k order. The two
output registers of a word are what one thread holds of a wgmma register A operand, so when the
weights are the A operand (swap-AB decode) Triton feeds the MMA straight from these registers, with
no shared-memory round trip (tools/sass_loop_stats.py shows no STS/LDSM in that loop).

Per 32-block, two table words hold the e4m3 bytes of the 8 magnitudes already scaled by 2^shift
(code 0 stays 0x00): t0 = 0x3C383000 + s * 0x08080800, t1 = 0x4C484440 + s * 0x08080808; every byte
stays in 0x08..0x7C for s in [-5, 6], so the multiply-add never carries between bytes. On the GPU
one word becomes two output words in inline asm (DESIGN.md section 4): `prmt.b32` picks four
magnitude bytes by the four 3-bit selectors of each half word, and the sign bits, stored where the
output's sign bits go, are masked in. About 10 instructions per 8 weights, all on 32-bit registers,
so Triton never packs or unpacks single bytes around the asm. Under the Triton interpreter inline
asm cannot run; USE_ASM=False computes the same words with integer arithmetic (a GPU test checks
that both give identical bytes).
"""

import triton
import triton.language as tl

# $0: e4m3 of k 4q..4q+3, $1: of k 16+4q..16+4q+3; $2: the word; $3, $4: the block's tables t0, t1.
# Outputs are written last: an output may share a register with an input (no early clobber).
_WORD_ASM = tl.constexpr("""
{
.reg .b32 sel, lo, hi, sg;
and.b32 sel, $2, 0x7777;
prmt.b32 lo, $3, $4, sel;
shr.u32 sel, $2, 16;
and.b32 sel, sel, 0x7777;
prmt.b32 hi, $3, $4, sel;
and.b32 sg, $2, 0x80808080;
or.b32 lo, lo, sg;
shl.b32 sg, $2, 4;
and.b32 sg, sg, 0x80808080;
or.b32 $1, hi, sg;
mov.b32 $0, lo;
}
""")


SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: the sign bit of each byte


@triton.jit
def _prmt_arith(sel, t0, t1):
    """What `prmt.b32 d, t0, t1, sel` gives for selectors 0..7 in the low four nibbles of sel."""
    out = tl.zeros_like(sel)
    for i in tl.static_range(4):
        m = (sel >> (4 * i)) & 7
        table = tl.where(m < 4, t0, t1)
        out |= ((table >> (8 * (m & 3))) & 0xFF) << (8 * i)
    return out


@triton.jit
def _byte(word, j: tl.constexpr):
    return ((word >> (8 * j)) & 0xFF).to(tl.uint8)


@triton.jit
def expand_e2m1_words(words, shift, USE_ASM: tl.constexpr):
    """kernel words int32 [BN, NB, 4], shift int32 [BN, NB] -> e4m3 [BN, NB*32] in k order."""
    BN: tl.constexpr = words.shape[0]
    NB: tl.constexpr = words.shape[1]
    t0 = tl.broadcast_to((0x3C383000 + shift * 0x08080800)[:, :, None], words.shape)
    t1 = tl.broadcast_to((0x4C484440 + shift * 0x08080808)[:, :, None], words.shape)
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(_WORD_ASM, "=r,=r,r,r,r", [words, t0, t1],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = _prmt_arith(words, t0, t1) | (words & SIGN_BITS)
        hi = _prmt_arith(words >> 16, t0, t1) | ((words << 4) & SIGN_BITS)
    # byte j = 4h + 2u + v of the word's 8 outputs (h: lo/hi): join adds the least significant axis last
    b0 = tl.join(_byte(lo, 0), _byte(hi, 0))
    b1 = tl.join(_byte(lo, 1), _byte(hi, 1))
    b2 = tl.join(_byte(lo, 2), _byte(hi, 2))
    b3 = tl.join(_byte(lo, 3), _byte(hi, 3))
    w = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [BN, NB, 4 (q), 2 (h), 2 (u), 2 (v)]
    w = tl.permute(w, (0, 1, 3, 2, 4, 5))  # k = 16h + 4q + 2u + v
    return tl.reshape(w, (BN, NB * 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def live_words(kt, groups, BK: tl.constexpr):
    """[BK/8] mask of K tile kt's kernel words whose 128-k group exists. Constant over each group's 16 words,
    so that masked loads stay 16-byte vectors (a per-word mask split them into 4-byte ones)."""
    return (kt * (BK // 128) + tl.arange(0, BK // 8) // 16) < groups


@triton.jit
def expand_weight_kernel(w_ptr, shift_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                         USE_ASM: tl.constexpr):
    """Write the e4m3 weight [N, K] the GEMM kernels see: the large-M path (cuBLAS fp8 on the
    result), tests, and the pre-expanded baseline. One [BN, BK] tile per program, BK % 128 == 0.
    The grid's third axis walks stacked experts ([E, N, ...] inputs, [E, N, K] output)."""
    G: tl.constexpr = BK // 128
    NB: tl.constexpr = BK // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = offs_n < N
    groups = tl.cdiv(K, 128)
    w_ptr += expert * N * (groups * 16)
    shift_ptr += expert * groups * N * 4
    out_ptr += expert * N * K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * (groups * 16) + pid_k * (BK // 8) + tl.arange(0, BK // 8)[None, :]
    words = tl.load(w_ptrs, mask=rows[:, None] & live_words(pid_k, groups, BK)[None, :], other=0)
    words = tl.reshape(tl.permute(tl.reshape(words, (BN, G, 4, 4)), (0, 1, 3, 2)), (BN, NB, 4))  # [BN, block, q]
    g = pid_k * G + tl.arange(0, G)
    s_ptrs = (shift_ptr + g[None, :, None].to(tl.int64) * N * 4 + offs_n[:, None, None] * 4
              + tl.arange(0, 4)[None, None, :])
    shift = tl.load(s_ptrs, mask=rows[:, None, None] & (g < groups)[None, :, None], other=0)
    w = expand_e2m1_words(words, tl.reshape(shift, (BN, NB)).to(tl.int32), USE_ASM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w,
             mask=rows[:, None] & (offs_k[None, :] < K))
