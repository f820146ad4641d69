"""Where does the decode GEMM lose bandwidth? At M=1, on the 8B shapes, in one run: a contiguous
read of the weight bytes, kernels that only stream the GEMM's weight tiles (row-major or 16-row tiled
layout, cp.async pipeline / register prefetch / TMA descriptor, with and without the e2m1 expansion),
and the GEMM itself over split counts and stages. Prints TB/s on the 4.25-bit bytes (bench/RESULTS.md,
fourth session):  python3 tools/decode_stream_probe.py"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from radiance.bench.kernels import random_mxfp4
from radiance.kernels.activation import quantize_activations
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.w4a8 import w4a8_gemm
from radiance.kernels.tuning import GemmConfig
from radiance.kernels.timing import time_us, copies_to_rotate
from radiance.kernels._triton.convert import expand_e2m1_words


@triton.jit
def contig_kernel(w_ptr, out_ptr, n_words, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    start = pid * per_prog
    for i in range(0, per_prog, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def stream_kernel(w_ptr, s_ptr, out_ptr, N, words_per_row, k_tiles_per_split, n_ktiles,
                  BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr, EXPAND: tl.constexpr,
                  PREFETCH_REGS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK // 8)
    G: tl.constexpr = BK // 128
    if TILED:
        ptrs = (w_ptr + (offs_n // 16).to(tl.int64)[:, None] * (words_per_row * 16) + (cols // 16)[None, :] * 256
                + (offs_n % 16)[:, None] * 16 + (cols % 16)[None, :])
        adv: tl.constexpr = G * 256
    else:
        ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * words_per_row + cols[None, :]
        adv: tl.constexpr = BK // 8
    s_ptrs = s_ptr + tl.arange(0, G)[None, :].to(tl.int64) * N + offs_n[:, None]
    kt_begin = pid_k * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, n_ktiles)
    acc = tl.zeros((BN, BK // 8), tl.int32)
    if PREFETCH_REGS:
        nxt = tl.load(ptrs + kt_begin * adv)
        for kt in range(kt_begin, kt_end):
            cur = nxt
            nxt = tl.load(ptrs + tl.minimum(kt + 1, kt_end - 1) * adv)
            acc ^= cur
    else:
        for kt in range(kt_begin, kt_end):
            words = tl.load(ptrs + kt * adv, eviction_policy="evict_first")
            if EXPAND:
                s = tl.load(s_ptrs + kt * G * N)
                b0 = (s << 24) >> 24
                sh = tl.reshape(tl.join(tl.join(b0, b0), tl.join(b0, b0)), (BN, G * 4))
                w3 = tl.reshape(words, (BN, BK // 32, 4))
                w = expand_e2m1_words(w3, sh, True)
                acc ^= tl.reshape(w.to(tl.int8, bitcast=True).to(tl.int32), (BN, BK // 8, 8)).sum(axis=2)
            else:
                acc ^= words
    tl.store(out_ptr + pid_n * 4096 + pid_k, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


@triton.jit
def stream_tma_kernel(desc, out_ptr, k_tiles_per_split, n_ktiles, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kt_begin = pid_k * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, n_ktiles)
    acc = tl.zeros((BN, BK // 8), tl.int32)
    for kt in range(kt_begin, kt_end):
        acc ^= desc.load([pid_n * BN, kt * (BK // 8)])
    tl.store(out_ptr + pid_n * 4096 + pid_k, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


def tiled_words(w_q):
    n, wpr = w_q.shape
    return w_q.reshape(n // 16, 16, wpr // 16, 16).permute(0, 2, 1, 3).contiguous()


def main():
    shapes = [(4096, 14336), (28672, 4096), (6144, 4096), (4096, 4096)]
    rows = []
    out = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    for n, k in shapes:
        wts = [prepare_mxfp4(*random_mxfp4(n, k, "cuda"))]
        nbytes = wts[0].w_q.numel() * 4 + wts[0].w_shift.numel()
        copies = copies_to_rotate(nbytes)
        wts += [prepare_mxfp4(*random_mxfp4(n, k, "cuda")) for _ in range(copies - 1)]
        tiled = [tiled_words(w.w_q) for w in wts]
        x_q, x_s = quantize_activations(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
        wpr = wts[0].w_q.shape[1]

        def tb(us):
            return nbytes / us / 1e6

        def rec(name, us):
            rows.append((f"{n}x{k}", name, us, tb(us)))
            print(f"{n}x{k} {name:40s} {us:8.2f} us {tb(us):6.2f} TB/s", flush=True)

        n_words = wts[0].w_q.numel()
        for progs in (264, 528, 1056):
            per = -(-n_words // progs)
            per = -(-per // 1024) * 1024
            us = time_us([lambda w=w: contig_kernel[(progs,)](w.w_q, out, n_words, per, BLOCK=1024, num_warps=4)
                          for w in wts])
            rec(f"contig progs={progs}", us)
        for bn, bk in ((64, 256), (64, 512), (128, 256)):
            n_kt = -(-k // bk)
            for splits in (1, 2, 4, 8):
                per = -(-n_kt // splits)
                sp = -(-n_kt // per)
                grid = (n // bn, sp)
                for tiled_l in (0, 1):
                    for stages in (3, 5):
                        ws = tiled if tiled_l else [w.w_q for w in wts]
                        us = time_us([lambda w=w, s=s: stream_kernel[grid](
                            w, s.w_shift.view(torch.int32), out, n, wpr, per, n_kt, BN=bn, BK=bk, TILED=tiled_l,
                            EXPAND=0, PREFETCH_REGS=0, num_warps=4, num_stages=stages) for w, s in zip(ws, wts)])
                        rec(f"stream bn{bn} bk{bk} sp{sp} tiled{tiled_l} st{stages}", us)
                if bn == 64 and bk == 256:
                    us = time_us([lambda w=w: stream_kernel[grid](
                        w.w_q, w.w_shift.view(torch.int32), out, n, wpr, per, n_kt, BN=bn, BK=bk, TILED=0,
                        EXPAND=1, PREFETCH_REGS=0, num_warps=4, num_stages=4) for w in wts])
                    rec(f"stream+expand bn{bn} bk{bk} sp{sp} st4", us)
                    us = time_us([lambda w=w: stream_kernel[grid](
                        w.w_q, w.w_shift.view(torch.int32), out, n, wpr, per, n_kt, BN=bn, BK=bk, TILED=0,
                        EXPAND=0, PREFETCH_REGS=1, num_warps=4, num_stages=1) for w in wts])
                    rec(f"stream regprefetch bn{bn} bk{bk} sp{sp}", us)
                    try:
                        descs = [TensorDescriptor.from_tensor(w.w_q, [bn, bk // 8]) for w in wts]
                        for stages in (3, 5):
                            us = time_us([lambda d=d: stream_tma_kernel[grid](d, out, per, n_kt, BN=bn, BK=bk,
                                                                               num_warps=4, num_stages=stages)
                                          for d in descs])
                            rec(f"stream TMA bn{bn} bk{bk} sp{sp} st{stages}", us)
                    except Exception as e:  # noqa: BLE001
                        print("TMA failed:", repr(e)[:300], flush=True)
        for splits in (1, 2, 3, 5, 8):
            for stages in (3, 4, 6):
                cfg = GemmConfig(block_m=16, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=stages,
                                 split_k=splits)
                us = time_us([lambda w=w: w4a8_gemm(x_q, x_s, w, config=cfg) for w in wts])
                rec(f"GEMM bn64 bk256 split{splits} st{stages}", us)
        us = time_us([lambda w=w: w4a8_gemm(x_q, x_s, w) for w in wts])
        rec("GEMM table config", us)
    print("\nSUMMARY")
    for r in rows:
        print(f"{r[0]:12s} {r[1]:40s} {r[2]:8.2f} {r[3]:6.2f}")


if __name__ == "__main__":
    main()
