"""e2m1 -> e4m3 expansion of MXFP4 tiles, with the block shift folded into the exponent.

Input: packed bytes [BN, NB, 16] (NB 32-blocks of 16 bytes, low nibble = even k) and int32 shifts
[BN, NB]. Output: e4m3 [BN, NB * 32] in natural k order.

On the GPU the expansion is byte-permute table lookups in inline asm (`prmt.b32`, DESIGN.md
section 4): four 3-bit magnitudes select four e4m3 bytes at once. The asm works on each input byte
independently (its low nibble gives the even-k output, its high nibble the odd-k output), so it is
correct whichever four elements Triton packs into one register; this is what makes it safe when
the expanded tile feeds the MMA straight from registers. The block shift arrives as one byte per
element, (s + 5) * 8, added to a table biased down by 5 exponent steps: every sum stays in 0x08..0x7C,
so the four byte lanes never carry into each other; a second table lookup zeroes code 0.
Under the Triton interpreter inline asm cannot run, so USE_ASM=False computes the same bytes with
integer arithmetic (a GPU test checks both give identical bytes).
"""

import triton
import triton.language as tl

# $0: e4m3 of the low nibbles, $1: of the high nibbles; $2: 4 packed input bytes; $3: 4 biased shifts.
# Outputs are written last: an output may share a register with an input (no early clobber).
_PRMT_ASM = tl.constexpr("""
{
.reg .b32 sel, tmp, mag, nz, sgn, lo, t0, t1, z0, z1, pick;
mov.b32 t0, 0x14100800;
mov.b32 t1, 0x24201C18;
mov.b32 z0, 0xFFFFFF00;
mov.b32 z1, 0xFFFFFFFF;
mov.b32 pick, 0x00000020;
and.b32 sel, $2, 0x07070707;
shr.u32 tmp, sel, 4;
or.b32 sel, sel, tmp;
prmt.b32 sel, sel, sel, pick;
prmt.b32 mag, t0, t1, sel;
prmt.b32 nz, z0, z1, sel;
add.u32 mag, mag, $3;
and.b32 mag, mag, nz;
shl.b32 sgn, $2, 4;
and.b32 sgn, sgn, 0x80808080;
or.b32 lo, mag, sgn;
shr.u32 sel, $2, 4;
and.b32 sel, sel, 0x07070707;
shr.u32 tmp, sel, 4;
or.b32 sel, sel, tmp;
prmt.b32 sel, sel, sel, pick;
prmt.b32 mag, t0, t1, sel;
prmt.b32 nz, z0, z1, sel;
add.u32 mag, mag, $3;
and.b32 mag, mag, nz;
and.b32 sgn, $2, 0x80808080;
or.b32 $1, mag, sgn;
mov.b32 $0, lo;
}
""")


@triton.jit
def _e4m3_bytes_arith(codes, shift):
    """codes int32 0..15, shift int32 (broadcastable) -> e4m3 bytes as int32."""
    mag = codes & 7
    byte = tl.where(mag == 1, 0x30, mag * 4 + 0x30) + shift * 8
    byte = tl.where(mag == 0, 0, byte)
    return byte | ((codes & 8) << 4)


@triton.jit
def expand_e2m1_tile(w3, shift, USE_ASM: tl.constexpr):
    """bytes [BN, NB, 16] uint8, shift [BN, NB] int32 -> e4m3 [BN, NB*32] in k order."""
    BN: tl.constexpr = w3.shape[0]
    NB: tl.constexpr = w3.shape[1]
    if USE_ASM:
        biased = ((shift + 5) * 8).to(tl.uint8)[:, :, None]
        even, odd = tl.inline_asm_elementwise(_PRMT_ASM, "=r,=r,r,r", [w3, biased],
                                              dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        b = w3.to(tl.int32)
        s = shift[:, :, None]
        even = _e4m3_bytes_arith(b & 0xF, s).to(tl.uint8)
        odd = _e4m3_bytes_arith(b >> 4, s).to(tl.uint8)
    w = tl.reshape(tl.join(even, odd), (BN, NB * 32))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def expand_weight_kernel(w_ptr, shift_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                         USE_ASM: tl.constexpr):
    """Write the e4m3 weight [N, K] the GEMM kernels see (tests, and the pre-expanded baseline)."""
    NB: tl.constexpr = BK // 32
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    rows = offs_n < N
    live = rows[:, None] & (blk[None, :] < K // 32)
    w_ptrs = w_ptr + offs_n[:, None, None] * (K // 2) + blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    w3 = tl.load(w_ptrs, mask=live[:, :, None], other=0)
    shift = tl.load(shift_ptr + offs_n[:, None] * (K // 32) + blk[None, :], mask=live, other=0).to(tl.int32)
    w = expand_e2m1_tile(w3, shift, USE_ASM)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=rows[:, None] & (offs_k[None, :] < K))
