"""Early PDL release (`triton_support.PDL_EARLY_RELEASE`) A/B'd inside the engine's decode step: a launch named there
lets the GEMM after it launch before it waits for the GEMM before it, so that the GEMM is resident and prefetching
while the GEMM before runs. The launches: the residual-add norms before qkv ("attn_norm") and before the MLP
("mlp_norm"), other norms ("norm"), the quantize between gate_up and down ("parts_quantize", production;
"moe_parts_quantize" before a grouped expert GEMM). bench/RESULTS.md, thirty-fourth session: the dense quantize
saves 20-30 us per 8B step at batch 1, both layer norms together are neutral (8B) to harmful (32B), the grouped
quantize costs gpt-oss-20b 200 us; the thirteenth session's early release in every kernel, before the occupancy
cap, lost 435 us per step. One engine, CUDA graphs re-captured per setting, the settings alternated `--repeats`
times.

    python3 tools/early_release_ab.py [--model synthetic:llama-3.1-8b] [--batches 1 8] \
        [--variants parts_quantize attn_norm,parts_quantize mlp_norm,parts_quantize]

On the CPU (`--device cpu`) it is a dry run of the harness: no PDL, no graphs, timings meaningless.
"""

from __future__ import annotations

import argparse

import decode_ablation  # tools/, next to this script
import radiance.kernels.triton_support as triton_support

RELEASABLE = triton_support.EARLY_RELEASE_LAUNCHES


def parse_variant(text: str) -> frozenset[str]:
    """"none" or comma-joined names of RELEASABLE."""
    names = frozenset() if text == "none" else frozenset(text.split(","))
    unknown = names - set(RELEASABLE)
    if unknown:
        raise ValueError(f"unknown launches {sorted(unknown)}; early release applies to: {', '.join(RELEASABLE)}")
    return names


def label(names: frozenset[str]) -> str:
    return ",".join(sorted(names)) or "none"


def run(model: str, variants, quantization: str = "mxfp4", batches=(1, 8), repeats: int = 3, device: str = "cuda",
        overrides: dict | None = None, steps: int = 24, log=print) -> list[tuple[frozenset, list[float]]]:
    """[(early-release set, [best-of-2 ms per decode step for each batch])] in run order."""
    engine = decode_ablation.ab_engine(model, quantization, batches, device, overrides)
    return decode_ablation.alternate(
        engine, triton_support, "PDL_EARLY_RELEASE", list(variants), batches, repeats, steps,
        lambda names, times: log(f"{label(names)}: " + "  ".join(f"batch {b} {ms:.3f} ms"
                                                                 for b, ms in zip(batches, times))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--variants", nargs="+", type=parse_variant,
                   default=[frozenset({"parts_quantize"}), frozenset({"attn_norm", "parts_quantize"}),
                            frozenset({"mlp_norm", "parts_quantize"})],
                   help="'none' or comma-joined launches to release early: " + ", ".join(RELEASABLE))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    run(args.model, args.variants, args.quantization, args.batches, args.repeats, args.device)


if __name__ == "__main__":
    main()
