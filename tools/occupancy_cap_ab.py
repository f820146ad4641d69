"""The occupancy cap of the graph-captured decode GEMMs (`w4a8.OCCUPANCY_CAP_IN_GRAPHS`: at most ceil(CTAs / SMs) of
a GEMM's CTAs per SM, kernels/occupancy.py) off and on, inside the engine's decode step: one engine, CUDA graphs
re-captured per setting, the settings alternated `--repeats` times (bench/RESULTS.md, thirty-second session).

    python3 tools/occupancy_cap_ab.py [--model synthetic:llama-3.1-8b] [--batches 1 8 32 64] [--repeats 3]

On the CPU (`--device cpu`) it is a dry run of the harness: no graphs, timings meaningless.
"""

from __future__ import annotations

import argparse

import decode_ablation  # tools/, next to this script
import radiance.kernels.w4a8 as w4a8_module


def run(model: str, quantization: str = "mxfp4", batches=(1, 8, 32, 64), repeats: int = 3, device: str = "cuda",
        overrides: dict | None = None, steps: int = 32, log=print) -> list[tuple[bool, list[float]]]:
    """[(cap on, [best-of-2 ms per decode step for each batch])] in run order (off first)."""
    engine = decode_ablation.ab_engine(model, quantization, batches, device, overrides)
    return decode_ablation.alternate(
        engine, w4a8_module, "OCCUPANCY_CAP_IN_GRAPHS", (False, True), batches, repeats, steps,
        lambda on, times: log(f"cap {'on ' if on else 'off'}: " + "  ".join(f"batch {b} {ms:.3f} ms"
                                                                          for b, ms in zip(batches, times))))


def table(rows, batches) -> list[str]:
    """Markdown rows: each setting's times per batch over the alternations."""
    lines = ["| cap | " + " | ".join(f"batch {b} ms" for b in batches) + " |", "|---|" + "---|" * len(batches)]
    for on in (False, True):
        runs = [times for value, times in rows if value == on]
        lines.append(f"| {'on' if on else 'off'} | "
                     + " | ".join(" / ".join(f"{t[i]:.3f}" for t in runs) for i in range(len(batches))) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--repeats", type=int, default=3, help="alternations of off / on")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    rows = run(args.model, args.quantization, args.batches, args.repeats, args.device)
    print("\n".join(table(rows, args.batches)))


if __name__ == "__main__":
    main()
