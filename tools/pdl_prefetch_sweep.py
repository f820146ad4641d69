"""How many K tiles of weights a W4A8 GEMM launched as a programmatic dependent prefetches into L2 before
its wait (`w4a8.PDL_PREFETCH_TILES`), measured inside the engine's decode step: one engine, CUDA graphs
re-captured per depth, the depths alternated `--repeats` times (bench/RESULTS.md, thirteenth session).
With `--shape NxK` only that GEMM shape's depth changes (`w4a8.PDL_PREFETCH_TILES_BY_SHAPE`).

    python3 tools/pdl_prefetch_sweep.py [--model synthetic:llama-3.1-8b] [--tiles 2 0 1] [--batches 1 64]
    python3 tools/pdl_prefetch_sweep.py --shape 4096x14336 --tiles 1 2 4 --batches 1 8

On the CPU (`--device cpu`) it is a dry run of the harness: no PDL, timings meaningless.
"""

from __future__ import annotations

import argparse

import decode_ablation  # tools/, next to this script
import radiance.kernels.w4a8 as w4a8_module


def parse_shape(text: str) -> tuple[int, int]:
    """"NxK" -> (n, k)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a GEMM shape is NxK, e.g. 4096x14336, not {text!r}") from None
    return n, k


def run(model: str, quantization: str = "mxfp4", tiles=(2, 0, 1), batches=(1, 64), repeats: int = 3,
        device: str = "cuda", overrides: dict | None = None, steps: int = 32, shape: tuple[int, int] | None = None,
        log=print) -> list[tuple[int, list[float]]]:
    """[(tiles, [best-of-2 ms per decode step for each batch])] in run order; `shape` (n, k): only that GEMM's
    depth changes."""
    if any(t < 0 for t in tiles):
        raise ValueError(f"prefetch depths are K tile counts >= 0, got {list(tiles)}")
    engine = decode_ablation.ab_engine(model, quantization, batches, device, overrides)
    if shape is None:
        name, values = "PDL_PREFETCH_TILES", list(tiles)
    else:
        others = {s: t for s, t in w4a8_module.PDL_PREFETCH_TILES_BY_SHAPE.items() if s != shape}
        name, values = "PDL_PREFETCH_TILES_BY_SHAPE", [{**others, shape: t} for t in tiles]
    rows = decode_ablation.alternate(
        engine, w4a8_module, name, values, batches, repeats, steps,
        lambda value, times: log(f"prefetch {_depth(value, shape):2d} tiles: "
                                 + "  ".join(f"batch {b} {ms:.4f} ms" for b, ms in zip(batches, times))))
    return [(_depth(value, shape), times) for value, times in rows]


def _depth(value, shape) -> int:
    return value if shape is None else value[shape]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--tiles", nargs="+", type=int, default=[2, 0, 1], help="prefetch depths, run in this order")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--repeats", type=int, default=3, help="alternations of the whole --tiles list")
    p.add_argument("--shape", type=parse_shape, help="NxK: change only this GEMM shape's depth (e.g. 4096x14336)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    run(args.model, args.quantization, args.tiles, args.batches, args.repeats, args.device, shape=args.shape)


if __name__ == "__main__":
    main()
