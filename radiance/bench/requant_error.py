"""Requantization error on real weights (CPU): direct MXFP4 per rule, NVFP4, NVFP4 -> MXFP4 per rule.

Every error is the relative RMS against the dequantized original weights (the GGUF's values for the
embedded SmolLM2), over all decoder linears: `overall` = sqrt(sum ||W - Q(W)||^2 / sum ||W||^2),
plus the per-layer mean and worst. Optionally times a whole-model `convert` on this machine.

    python -m radiance.bench.requant_error [--model PATH] [--layers N] [--convert-time] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import torch

from radiance.checkpoint import is_weight, open_checkpoint
from radiance.formats import (RULES, dense_to_mxfp4, dequantize, dequantize_mxfp4, dequantize_nvfp4, nvfp4_to_mxfp4,
                              quantize_nvfp4)

logger = logging.getLogger(__name__)


class _Acc:
    """Squared-error accumulator for one variant."""

    def __init__(self):
        self.err = 0.0
        self.ref = 0.0
        self.per_layer: list[tuple[str, float]] = []

    def add(self, name: str, approx: torch.Tensor, ref: torch.Tensor) -> None:
        err = float((approx - ref).square().sum(dtype=torch.float64))
        norm = float(ref.square().sum(dtype=torch.float64))
        self.err += err
        self.ref += norm
        self.per_layer.append((name, (err / norm) ** 0.5 if norm else 0.0))

    def row(self) -> dict:
        worst = max(self.per_layer, key=lambda x: x[1])
        return {"overall": (self.err / self.ref) ** 0.5, "mean": sum(v for _, v in self.per_layer) / len(self.per_layer),
                "worst": worst[1], "worst_layer": worst[0], "layers": len(self.per_layer)}


def measure(model: str | None, max_layers: int | None = None) -> tuple[dict, float]:
    ckpt = open_checkpoint(model)
    acc: dict[str, _Acc] = {}
    started = time.perf_counter()
    for name, obj in ckpt.iter_weights(progress=True):
        if not is_weight(obj):
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if max_layers is not None and layer is not None and int(layer) >= max_layers:
            continue
        w = dequantize(obj)
        for rule in RULES:
            packed, scale, _ = dense_to_mxfp4(w, rule)
            acc.setdefault(f"direct mxfp4 ({rule})", _Acc()).add(name, dequantize_mxfp4(packed, scale), w)
        nv_packed, nv_scale, gs = quantize_nvfp4(w, obj.partition_sizes)
        acc.setdefault("nvfp4", _Acc()).add(name, dequantize_nvfp4(nv_packed, nv_scale, gs, obj.partition_sizes), w)
        for rule in RULES:
            packed, scale, _ = nvfp4_to_mxfp4(nv_packed, nv_scale, gs, obj.partition_sizes, rule)
            acc.setdefault(f"nvfp4 -> mxfp4 ({rule})", _Acc()).add(name, dequantize_mxfp4(packed, scale), w)
    return {k: v.row() for k, v in acc.items()}, time.perf_counter() - started


def time_convert(model: str | None, fmt: str, rule: str) -> tuple[float, str]:
    from radiance.checkpoint.writer import convert_checkpoint
    from radiance.config import ConvertConfig

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        report = convert_checkpoint(model, os.path.join(tmp, "out"), ConvertConfig(format=fmt, rule=rule),
                                    progress=False)
        return time.perf_counter() - started, report.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF dir or GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--layers", type=int, default=None, help="only the first N decoder layers")
    parser.add_argument("--convert-time", action="store_true", help="also time whole-model convert (mxfp4 mse)")
    parser.add_argument("--convert-only", action="store_true", help="only time the whole-model converts")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows, seconds = ({}, 0.0) if args.convert_only else measure(args.model, args.layers)
    result = {"model": args.model or "embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
              "threads": torch.get_num_threads(), "measure_seconds": seconds, "rows": rows}
    if args.convert_time or args.convert_only:
        for fmt in ("mxfp4", "nvfp4"):
            result[f"convert_{fmt}_seconds"], result[f"convert_{fmt}_summary"] = time_convert(args.model, fmt, "mse")
    if rows:
        print(f"\nrelRMS vs the dequantized original weights ({rows['nvfp4']['layers']} linears, "
              f"torch threads {result['threads']}, {seconds:.1f} s)")
        print(f"| {'variant':<26} | overall | per-layer mean | worst (layer) |")
        print(f"|{'-' * 28}|---------|----------------|---------------|")
    for variant, r in rows.items():
        print(f"| {variant:<26} | {r['overall']:.4f}  | {r['mean']:.4f}         | {r['worst']:.4f} ({r['worst_layer']}) |")
    for fmt in ("mxfp4", "nvfp4"):
        if f"convert_{fmt}_seconds" in result:
            print(f"whole-model convert to {fmt}: {result[f'convert_{fmt}_seconds']:.1f} s "
                  f"({result[f'convert_{fmt}_summary']})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
