"""Requantization to MXFP4, row-chunked so the fp32 transient stays bounded.

Any source whose rows can be dequantized on demand (NVFP4 per partition, FP8 per channel, 16-bit)
goes through `requant_rows_to_mxfp4`: dequantize a chunk of rows to fp32, quantize it to MXFP4,
accumulate the squared error for the relative RMS report.
"""

from __future__ import annotations

from typing import Callable

import torch

from radiance.formats._checks import check_finite, check_partitions
from radiance.formats.mxfp4 import MX_BLOCK, RULES, quantize_mxfp4, dequantize_mxfp4
from radiance.formats.nvfp4 import check_block_scales, dequantize_nvfp4

TRANSIENT_BYTES = 256 << 20  # fp32 bytes of one dequantized chunk (the codec makes ~4 such temporaries)


def default_chunk_rows(k: int) -> int:
    return max(1, TRANSIENT_BYTES // (4 * k))


def requant_rows_to_mxfp4(dequant_rows: Callable[[int, int], torch.Tensor], n: int, k: int, device,
                          rule: str = "mse", chunk_rows: int | None = None):
    """Quantize the fp32 rows `dequant_rows(start, stop)` of an [n, k] matrix to MXFP4.

    Returns (packed [n, k/2], scale_e8m0 [n, k/32], rel_rms) with rel_rms = ||W - Q(W)|| / ||W||.
    """
    if rule not in RULES:
        raise ValueError(f"unknown MXFP4 rule {rule!r}; expected one of {RULES}")
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K to be a multiple of {MX_BLOCK}, got K={k}")
    chunk_rows = chunk_rows or default_chunk_rows(k)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((n, k // MX_BLOCK), dtype=torch.uint8, device=device)
    err = torch.zeros((), dtype=torch.float64, device=device)
    ref = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        rows = dequant_rows(start, stop).float()
        check_finite(rows, "the dequantized weight", row_offset=start)  # a NaN source value, named by its row
        p, s = quantize_mxfp4(rows, rule)
        packed[start:stop], scale[start:stop] = p, s
        # squared in float64: fp32 squares of weights near 1e20 overflowed (a nan report), near 1e-25 underflowed
        err += (rows.double() - dequantize_mxfp4(p, s).double()).square().sum()
        ref += rows.double().square().sum()
    rel_rms = float((err / ref).sqrt()) if float(ref) > 0 else 0.0
    return packed, scale, rel_rms


def nvfp4_to_mxfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   partition_sizes=None, rule: str = "mse", chunk_rows: int | None = None):
    """NVFP4 -> MXFP4 per partition (each dequantized with its own global scale), row-chunked.

    Returns (packed uint8 [N, K/2], scale_e8m0 uint8 [N, K/32], rel_rms vs the NVFP4 values).
    """
    n = packed.shape[0]
    global_scale = torch.as_tensor(global_scale, device=packed.device).float().reshape(-1)
    sizes = check_partitions(n, partition_sizes, global_scale.numel())
    check_block_scales(scale)  # here, on all rows, so the index it reports is not a chunk's
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def rows(start: int, stop: int) -> torch.Tensor:
        # Split [start, stop) at partition borders so each piece uses its own global scale.
        pieces = []
        for p, (p0, size) in enumerate(zip(starts, sizes)):
            a, b = max(start, p0), min(stop, p0 + size)
            if a < b:
                pieces.append(dequantize_nvfp4(packed[a:b], scale[a:b], global_scale[p:p + 1]))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    return requant_rows_to_mxfp4(rows, n, packed.shape[1] * 2, packed.device, rule, chunk_rows)


def dense_to_mxfp4(w: torch.Tensor, rule: str = "mse", chunk_rows: int | None = None):
    """16/32-bit [N, K] -> (packed, scale_e8m0, rel_rms), row-chunked."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"dense_to_mxfp4 needs a 2-D floating-point weight, got {w.dtype} {tuple(w.shape)}")
    check_finite(w, "w")
    return requant_rows_to_mxfp4(lambda a, b: w[a:b], w.shape[0], w.shape[1], w.device, rule, chunk_rows)


def dense_to_mxfp4_pair(w: torch.Tensor, rule: str = "mse", chunk_rows: int | None = None):
    """16/32-bit [N, K] -> two MXFP4 terms side by side along K: Q1 = Q(W), Q2 = Q(W - Q1), so that
    [x | x] @ [Q1 | Q2]^T = x @ (Q1 + Q2)^T. 8.5 bits per weight, about 1/8 of one term's error (relRMS
    1.3-1.4% against 11-12% on Gaussian and SmolLM2 weights; fp8 per row: 2.6%). Row-chunked.

    Returns (packed uint8 [N, K], scale_e8m0 uint8 [N, K/16], rel_rms of Q1 + Q2 against W).
    """
    p1, s1, rel1 = dense_to_mxfp4(w, rule, chunk_rows)
    n, k = w.shape

    def residual(a: int, b: int) -> torch.Tensor:
        return w[a:b].float() - dequantize_mxfp4(p1[a:b], s1[a:b])

    p2, s2, rel2 = requant_rows_to_mxfp4(residual, n, k, w.device, rule, chunk_rows)
    # ||W - Q1 - Q2|| / ||W|| = (||R - Q(R)|| / ||R||) * (||R|| / ||W||) with R = W - Q1
    return torch.cat((p1, p2), dim=1), torch.cat((s1, s2), dim=1), rel1 * rel2
