"""Launch the W4A8 GEMM a few times on one shape, nothing else: a target for `ncu`.

    ncu --clock-control none --set full -k regex:w4a8_gemm -c 1 python3 tools/one_gemm.py 4096 14336 1
"""

import argparse

import torch

from radiance.bench.kernels import random_mxfp4
from radiance.kernels.activation import quantize_activations
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.w4a8 import w4a8_gemm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int)
    p.add_argument("k", type=int)
    p.add_argument("m", type=int)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    weight = prepare_mxfp4(*random_mxfp4(args.n, args.k, "cuda"))
    x_q, x_scale = quantize_activations(torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16))
    for _ in range(args.repeats):
        w4a8_gemm(x_q, x_scale, weight)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
