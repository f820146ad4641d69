"""Times the Gated DeltaNet prefill kernels (kernels/_triton/gated_delta_prefill: the recurrent form over its tilings
block_v x num_warps, the chunked form over its block_v) at Qwen3.5-9B's head shapes (16 key heads, 32 value heads,
128 x 128 state per value head), for one sequence of each length; prints ms per layer, us per token, and x 24 layers
(the 9B's linear-attention layers), each checked against the recurrent form's default output first.

    python3 tools/gated_delta_prefill_sweep.py [--lengths 64 1024 8192] [--tilings 8x1 4x1 16x1 32x4]
        [--chunked 32/ieee/8/rows 32:64/tf32x3:tf32/4:8:8/doubling ...]   (block_v[:output_block_v] / tl.dot
        input_precision[:the output launch's] / num_warps[:scan_warps[:output_warps]] / how a chunk's (I + A) is
        inverted); each chunked form's three launches timed apart too (torch.profiler)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from radiance.kernels._triton.gated_delta_chunked import chunked_prefill, delta_chunks
from radiance.kernels._triton.gated_delta_prefill import recurrent_prefill

HK, HV, DK, DV, LAYERS = 16, 32, 128, 128, 24


def parse_tiling(text: str) -> tuple[int, int]:
    block_v, warps = text.split("x")
    return int(block_v), int(warps)


def inputs(length: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(length)
    mixed = torch.randn(length, 2 * HK * DK + HV * DV, device=device, generator=gen).bfloat16()
    q, k, v = mixed.split((HK * DK, HK * DK, HV * DV), dim=-1)
    q, k, v = q.view(length, HK, DK), k.view(length, HK, DK), v.view(length, HV, DV)
    g = F.logsigmoid(torch.randn(length, HV, device=device, generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(length, HV, device=device, generator=gen))
    state = torch.zeros(1, HV, DK, DV, device=device)
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    return q, k, v, g, beta, state, cu


def parse_chunked(text: str) -> dict:
    """BLOCK_V[:OUTPUT_BLOCK_V]/PRECISION[:OUTPUT_PRECISION]/WARPS[:SCAN_WARPS[:OUTPUT_WARPS]]/INVERSE[/SCAN_STAGES]
    -> chunked_prefill's keyword arguments; a value not given is the one before it (the output launch's warps: WARPS),
    but for OUTPUT_PRECISION and SCAN_STAGES: chunked_prefill's defaults (single tf32 for a 16-bit output under
    tf32x3; Triton's num_stages)."""
    block_v, precision, warps, inverse, *stages = text.split("/")
    if len(stages) > 1:
        raise ValueError(f"a chunked form has 4 or 5 fields: {text!r}")
    scan_v, _, output_v = block_v.partition(":")
    precision, _, output_precision = precision.partition(":")
    warps, _, rest = warps.partition(":")
    scan_warps, _, output_warps = rest.partition(":")
    return dict(block_v=int(scan_v), output_block_v=int(output_v or scan_v), precision=precision,
                output_precision=output_precision or None, num_warps=int(warps),
                scan_warps=int(scan_warps or warps), output_warps=int(output_warps or warps), inverse=inverse,
                scan_stages=int(stages[0]) if stages else None)


def chunked_label(form: dict) -> str:
    output_precision = f":{form['output_precision']}" if form["output_precision"] else ""
    stages = f"/{form['scan_stages']}" if form.get("scan_stages") is not None else ""
    return (f"chunked {form['block_v']}:{form['output_block_v']}/{form['precision']}{output_precision}/"
            f"{form['num_warps']}:{form['scan_warps']}:{form['output_warps']}/{form['inverse']}{stages}")


def launch_split(run) -> str:
    """The device time of each kernel one call of `run` launches, by kernel name (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
    return ", ".join(f"{name.removesuffix('_kernel')} {ms:.3f}" for name, ms in times.items() if "chunk" in name)


def time_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(length: int, label: str, run, want: torch.Tensor) -> tuple:
    error = ((run().float() - want.float()).abs().max() / want.float().abs().max()).item()
    ms = time_ms(run)
    row = (length, label, ms, ms * 1e3 / length, ms * LAYERS, error)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 8192])
    parser.add_argument("--tilings", type=parse_tiling, nargs="+",
                        default=[(8, 1), (4, 1), (16, 1), (32, 4), (16, 4), (8, 2)])
    # default: the served form (32:64/tf32x3/4:8/blocks: the output launch in single tf32 for this bf16 input), its
    # output launch in tf32x3 (served until the seventy-first session), the doubling inverse, the ieee row-by-row one
    parser.add_argument("--chunked", type=parse_chunked, nargs="+",
                        metavar="BLOCK_V[:OUT]/PRECISION[:OUT]/WARPS[:SCAN[:OUT]]/INVERSE",
                        default=[parse_chunked(c) for c in ("32:64/tf32x3/4:8/blocks",
                                                            "32:64/tf32x3:tf32x3/4:8/blocks",
                                                            "32:64/tf32x3/4:8/doubling", "32/ieee/8/rows")])
    parser.add_argument("--json", help="write the table's rows here too")
    args = parser.parse_args()
    device = torch.device("cuda")
    slots, continues = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int32,
                                                                                       device=device)
    rows = []
    for length in args.lengths:
        q, k, v, g, beta, state, cu = inputs(length, device)
        want = recurrent_prefill(q, k, v, g, beta, state.clone(), slots, cu, continues)
        for block_v, warps in args.tilings:
            def run():
                return recurrent_prefill(q, k, v, g, beta, state.clone(), slots, cu, continues, block_v=block_v,
                                         num_warps=warps)
            rows.append(measure(length, f"{block_v}x{warps}", run, want))
        chunks = delta_chunks([length], device)
        for form in args.chunked:
            def run():
                return chunked_prefill(q, k, v, g, beta, state.clone(), slots, chunks, continues, **form)
            label = chunked_label(form)
            try:
                rows.append(measure(length, label, run, want))
            except Exception as exc:  # e.g. a form that needs more shared memory than the GPU has: the rest still run
                print(f"{length} {label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            print(f"{length} {label}: ms by launch: {launch_split(run)}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(zip(("tokens", "form", "ms", "us_per_token", "ms_24_layers", "error"), row)) for row in rows],
                      fh, indent=1)
    print("\n| tokens | form | ms / layer | us / token | ms x 24 layers | max rel. diff vs default |")
    for length, tiling, ms, per_token, total, error in rows:
        print(f"| {length} | {tiling} | {ms:.3f} | {per_token:.3f} | {total:.1f} | {error:.1e} |")


if __name__ == "__main__":
    main()
