"""The lm_head options side by side on one GPU: the 16-bit head (cuBLAS), one MXFP4 term and two MXFP4
terms (Mxfp4PairLinear) on the W4A8 kernel, activation quantization included, random weights of a
model's head shape. Prints us per call, TB/s on each option's weight bytes, and the speedup over bf16.

    python3 tools/lm_head_bench.py                      # Llama-3.1-8B's head, 128256 x 4096
    python3 tools/lm_head_bench.py --n 151936 --k 5120  # Qwen3-32B's
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from radiance.formats import dense_to_mxfp4, dense_to_mxfp4_pair
from radiance.kernels.timing import time_us
from radiance.layers.linear import Mxfp4Linear, Mxfp4PairLinear


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=128256, help="vocabulary size (head rows)")
    parser.add_argument("--k", type=int, default=4096, help="hidden size")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64], help="tokens per call")
    args = parser.parse_args(argv)
    n, k = args.n, args.k
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    one = Mxfp4Linear(*dense_to_mxfp4(w)[:2])
    pair = Mxfp4PairLinear(*dense_to_mxfp4_pair(w)[:2])
    options = {"bf16": (lambda x: F.linear(x, w), 2 * n * k),
               "mxfp4": (one, n * k * 17 // 32),
               "mxfp4x2": (pair, n * k * 17 // 16)}
    print(f"lm_head {n} x {k}; us per call (activation quantization included), TB/s on the weight bytes")
    print("| M | option | us | TB/s | x bf16 |")
    print("|---|---|---|---|---|")
    for m in args.m:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = None
        for name, (fn, nbytes) in options.items():
            us = time_us([lambda x=x, f=fn: f(x)])  # every option's weight is several times the 60 MB L2
            base = base or us
            print(f"| {m} | {name} | {us:.1f} | {nbytes / us / 1e6:.2f} | {base / us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
