"""How long does the decode GEMM's MMA chain take by itself? Times a kernel whose K loop is only the
register-A fp8 wgmma chain of the swap-AB decode tiling (weights made in registers from the loop
index, activations resident in shared memory), against CTAs per SM, so the per-K-tile cost of the MMA
(and of the fp32 promotion) can be set beside the GEMM's (bench/RESULTS.md, fourth session: ~0.7 us
per 64 x 256 tile per CTA with 2.4 CTAs per SM).

    python3 tools/wgmma_probe.py            # on the GPU; prints ns per K tile per CTA for each variant
"""

from __future__ import annotations

import triton
import triton.language as tl

from radiance.kernels._triton.convert import _byte, expand_e2m1_words


@triton.jit
def _words_to_e4m3(words, EXPAND: tl.constexpr):
    """Kernel words [BN, NB, 4] -> e4m3 [BN, NB * 32] in the register-A layout: the real expansion
    (zero block shifts), or two instructions per word through the same byte layout (timing only)."""
    if EXPAND:
        return expand_e2m1_words(words, tl.zeros((words.shape[0], words.shape[1]), tl.int32), True)
    lo, hi = tl.inline_asm_elementwise("and.b32 $1, $2, 0x3F3F3F3F; and.b32 $0, $2, 0x37373737;", "=r,=r,r",
                                       [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    b0 = tl.join(_byte(lo, 0), _byte(hi, 0))
    b1 = tl.join(_byte(lo, 1), _byte(hi, 1))
    b2 = tl.join(_byte(lo, 2), _byte(hi, 2))
    b3 = tl.join(_byte(lo, 3), _byte(hi, 3))
    w = tl.permute(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (0, 1, 3, 2, 4, 5))
    return tl.reshape(w, (words.shape[0], words.shape[1] * 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def wgmma_chain_kernel(x_ptr, out_ptr, iters, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PRECISE: tl.constexpr, EXPAND: tl.constexpr):
    """acc[BN, BM] += w_i @ x^T for i < iters: the GEMM's K loop without its loads. w_i comes from kernel
    words derived from i in registers (so nothing is loop-invariant), x stays in shared memory."""
    NB: tl.constexpr = BK // 32
    x = tl.load(x_ptr + tl.arange(0, BM)[:, None] * BK + tl.arange(0, BK)[None, :])
    base = (tl.arange(0, BN)[:, None, None] * 131 + tl.arange(0, NB)[None, :, None] * 17
            + tl.arange(0, 4)[None, None, :]) * 0x01010101
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for i in range(iters):
        w = _words_to_e4m3(base ^ i, EXPAND)
        if PRECISE:
            acc += tl.dot(w, tl.trans(x))
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    tl.store(out_ptr + tl.program_id(0) * BN * BM + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :], acc)


def main() -> None:
    import itertools

    import torch

    from radiance.kernels.device_info import sm_count

    sms = sm_count(torch.device("cuda"))
    iters = 2000
    print(f"{'BM':>3} {'BN':>4} {'BK':>4} {'precise':>7} {'expand':>6} {'CTAs/SM':>7}  ns per K tile per CTA"
          "   SM-level ns per tile")
    for bm, bn, bk in ((16, 64, 256), (16, 128, 256), (64, 64, 256)):
        x = (torch.rand(bm, bk, device="cuda") + 0.5).to(torch.float8_e4m3fn)
        for precise, expand, per_sm in itertools.product((True, False), (True, False), (1, 2, 3, 4)):
            if True:
                grid = sms * per_sm
                out = torch.empty(grid * bn * bm, device="cuda")
                launch = lambda: wgmma_chain_kernel[(grid,)](x, out, iters, BM=bm, BN=bn, BK=bk,  # noqa: E731
                                                             PRECISE=precise, EXPAND=expand, num_warps=4,
                                                             num_stages=1)
                launch()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    launch()
                end.record()
                torch.cuda.synchronize()
                ns = start.elapsed_time(end) / 5 * 1e6 / iters
                print(f"{bm:>3} {bn:>4} {bk:>4} {str(precise):>7} {str(expand):>6} {per_sm:>7}  {ns:18.1f}   "
                      f"{ns / per_sm:18.1f}", flush=True)


if __name__ == "__main__":
    main()
