"""The grouped W4A8 expert GEMMs of a mixture-of-experts model at decode and small-prefill token counts, side by
side with one dense W4A8 GEMM over the same experts' bytes (what the grouped launches would take if a token's
experts were one weight: the streaming ceiling) and torch's bf16 grouped GEMM on the same routing (the 16-bit
path, without the expert biases). The measurement behind bench/RESULTS.md's twenty-seventh session (there as
scratch scripts; the tool's first GPU run: twenty-eighth session, part 4).

    python3 tools/moe_gemm_bench.py --model synthetic:gpt-oss-20b --tokens 1 4 16 64
    python3 tools/moe_gemm_bench.py --model synthetic:qwen3-30b-a3b --tokens 256 384 512 --block-m 16 64 128
    python3 tools/moe_gemm_bench.py --shapes 128,8,4096,1536 --tokens 384 2048 --block-m 16 64 128  # Qwen3-235B-A22B

--block-m times the grouped W4A8 path with each routing tile forced (16, 64 or 128 slots per tile) and marks the one
moe.moe_block_m picks: how moe.PREFILL_PAIRS_PER_EXPERT and LARGE_PAIRS_PER_EXPERT were chosen (bench/RESULTS.md,
twenty-eighth session).

Per token count, 16 random routings (distinct experts per token) run back to back in one CUDA-graph replay per
path, so that most expert weights come from HBM; microseconds per call of gate_up (with the GLU and the
quantization of its output; bf16: the GLU) and of down. The dense ceiling is timed at one token only. CUDA only;
--dry-run builds every call at toy sizes on the CPU (Triton interpreter) and, instead of timing, checks the W4A8
path against its exact reference and the bf16 one against each pair's expert applied alone
(tests/bench/test_moe_gemm_bench.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from radiance import env
from radiance.bench.kernels import random_mxfp4
from radiance.bench.synthetic import synthetic_config
from radiance.kernels import moe as grouped
from radiance.kernels.activation import quantize_activations
from radiance.kernels.glu import SILU, GluActivation, glu_mul, glu_reference
from radiance.kernels.moe_routing import route_to_experts
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.reference import relative_error
from radiance.kernels.timing import time_us
from radiance.kernels.w4a8 import w4a8_gemm, w4a8_glu
from radiance.models.arch_config import MoeConfig

ROUTINGS = 16


@dataclass(frozen=True)
class ExpertShapes:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    biased: bool
    activation: GluActivation


def model_shapes(model: str) -> ExpertShapes:
    """The expert shapes of a synthetic MoE model's published config."""
    config = synthetic_config(model)
    moe = MoeConfig.from_hf(config, model, int(config["num_hidden_layers"]))
    if moe is None:
        raise SystemExit(f"{model} has no mixture-of-experts layers")
    return ExpertShapes(moe.num_experts, moe.top_k, int(config["hidden_size"]), moe.intermediate_size,
                        moe.expert_bias, moe.activation)


def parse_shapes(spec: str) -> ExpertShapes:
    """'EXPERTS,TOP_K,HIDDEN,INTERMEDIATE' -> SiLU-gated experts without biases (Qwen3-MoE's kind), for models
    without a synthetic config (Qwen3-235B-A22B: 128,8,4096,1536)."""
    try:
        experts, top_k, hidden, intermediate = (int(v) for v in spec.split(","))
    except ValueError:
        raise SystemExit(f"--shapes {spec!r}: expected four integers EXPERTS,TOP_K,HIDDEN,INTERMEDIATE") from None
    if min(experts, top_k, hidden, intermediate) < 1 or top_k > experts:
        raise SystemExit(f"--shapes {spec!r}: every size must be positive and TOP_K at most EXPERTS")
    return ExpertShapes(experts, top_k, hidden, intermediate, False, SILU)


class Workload:
    """Random MXFP4 and bf16 experts of `shapes`, and ROUTINGS random routings of `tokens` tokens each, in routing
    tiles of `block_m` slots (None: the one moe.moe_block_m picks)."""

    def __init__(self, shapes: ExpertShapes, tokens: int, device: str, block_m: int | None = None):
        s = self.shapes = shapes
        # bf16 as served; fp32 on the CPU, where the interpreter's bf16 rounding is not the GPU's (triton_cases_gemm)
        dtype = self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.gate_up = grouped.stack_experts([prepare_mxfp4(*random_mxfp4(2 * s.intermediate, s.hidden, device))
                                              for _ in range(s.experts)])
        self.down = grouped.stack_experts([prepare_mxfp4(*random_mxfp4(s.hidden, s.intermediate, device))
                                           for _ in range(s.experts)])
        self.biases = ((torch.randn(s.experts, 2 * s.intermediate, device=device),
                        torch.randn(s.experts, s.hidden, device=device)) if s.biased else (None, None))
        self.w16 = (torch.randn(s.experts, 2 * s.intermediate, s.hidden, device=device, dtype=dtype) * 0.02,
                    torch.randn(s.experts, s.hidden, s.intermediate, device=device, dtype=dtype) * 0.02)
        block_m = block_m or grouped.moe_block_m(tokens * s.top_k, s.experts)
        self.ids, self.x, self.x_q, self.routing, self.sorted = [], [], [], [], []
        for _ in range(ROUTINGS):
            ids = torch.stack([torch.randperm(s.experts, device=device)[:s.top_k] for _ in range(tokens)])
            x = torch.randn(tokens, s.hidden, device=device, dtype=dtype)
            self.ids.append(ids)
            self.x.append(x)
            self.x_q.append(quantize_activations(x))
            self.routing.append(route_to_experts(ids, s.experts, block_m))
            self.sorted.append(route_to_experts(ids, s.experts, 1))
        self.y_q = [self.gate_up_w4a8(i) for i in range(ROUTINGS)]

    def gate_up_w4a8(self, i: int):
        x_q, x_scale = self.x_q[i]
        return grouped.w4a8_moe_gemm(x_q, x_scale, self.gate_up, self.routing[i], rows_per_pair_source="token",
                                     glu=True, out_dtype=self.dtype, bias=self.biases[0],
                                     activation=self.shapes.activation)

    def down_w4a8(self, i: int):
        y_q, y_scale = self.y_q[i]
        return grouped.w4a8_moe_gemm(y_q, y_scale, self.down, self.routing[i], rows_per_pair_source="pair",
                                     out_dtype=self.dtype, bias=self.biases[1])

    def gate_up_bf16(self, i: int):
        routing = self.sorted[i]
        rows = self.x[i][routing.sorted_pairs.long() // self.shapes.top_k]
        return glu_mul(torch._grouped_mm(rows, self.w16[0].transpose(1, 2), offs=routing.group_ends),
                       self.shapes.activation)

    def down_bf16(self, i: int, y):
        return torch._grouped_mm(y, self.w16[1].transpose(1, 2), offs=self.sorted[i].group_ends)


def dense_ceiling_us(shapes: ExpertShapes) -> tuple[float, float]:
    """(gate_up + quantize, down) us of one dense W4A8 GEMM at M = 1 over the bytes of top_k experts."""
    k, i = shapes.top_k, shapes.intermediate
    gate_up = prepare_mxfp4(*random_mxfp4(2 * i * k, shapes.hidden, "cuda"))
    down = prepare_mxfp4(*random_mxfp4(shapes.hidden, i * k, "cuda"))
    x_q, x_scale = quantize_activations(torch.randn(1, shapes.hidden, device="cuda", dtype=torch.bfloat16))
    y_q, y_scale = quantize_activations(torch.randn(1, i * k, device="cuda", dtype=torch.bfloat16))
    return (time_us([lambda: w4a8_glu(x_q, x_scale, gate_up)]), time_us([lambda: w4a8_gemm(y_q, y_scale, down)]))


def w4a8_us(workload: Workload) -> tuple[float, float]:
    """(gate_up us, down us) per call of the grouped W4A8 path."""
    return (time_us([lambda i=i: workload.gate_up_w4a8(i) for i in range(ROUTINGS)]),
            time_us([lambda i=i: workload.down_w4a8(i) for i in range(ROUTINGS)]))


def bf16_us(workload: Workload) -> tuple[float, float]:
    """(gate_up us, down us) per call of torch's bf16 grouped GEMM on the same routings."""
    y16 = [workload.gate_up_bf16(i) for i in range(ROUTINGS)]
    return (time_us([lambda i=i: workload.gate_up_bf16(i) for i in range(ROUTINGS)]),
            time_us([lambda i=i: workload.down_bf16(i, y16[i]) for i in range(ROUTINGS)]))


def check(workload: Workload) -> tuple[float, float]:
    """Largest relative errors (dry run): the grouped W4A8 down output against its exact reference, and the bf16
    grouped path's against each pair's expert applied one by one."""
    worst_w4a8 = worst_bf16 = 0.0
    for i in range(ROUTINGS):
        y_q, y_scale = workload.y_q[i]
        want = grouped.w4a8_moe_reference(y_q, y_scale, workload.down, workload.ids[i], rows_per_pair_source="pair",
                                          out_dtype=workload.dtype, bias=workload.biases[1])
        worst_w4a8 = max(worst_w4a8, relative_error(workload.down_w4a8(i).float(), want.float()))
        pairs = workload.sorted[i].sorted_pairs.long()  # slot -> pair (block_m 1: no padding)
        expert = workload.ids[i].reshape(-1)[pairs]
        gate_up = (workload.w16[0][expert] @ workload.x[i][pairs // workload.shapes.top_k, :, None])[..., 0]
        one_by_one = (workload.w16[1][expert] @ glu_reference(gate_up, workload.shapes.activation)[..., None])[..., 0]
        got = workload.down_bf16(i, workload.gate_up_bf16(i))
        worst_bf16 = max(worst_bf16, relative_error(got.float(), one_by_one.float()))
    return worst_w4a8, worst_bf16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:gpt-oss-20b", help="a synthetic MoE model (its config's shapes)")
    parser.add_argument("--shapes", metavar="E,K,H,I", help="expert shapes instead of --model's: experts, top_k, hidden, "
                        "intermediate (SiLU, no biases), e.g. 128,8,4096,1536 for Qwen3-235B-A22B")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--block-m", type=int, nargs="+", choices=sorted(grouped.MOE_CONFIGS),
                        help="time the grouped W4A8 path with each of these routing tiles forced")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, checked instead of timed")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes) if args.shapes else model_shapes(args.model)
    name = f"experts {args.shapes}" if args.shapes else args.model  # how the rows name the workload
    if args.dry_run:
        if not env.triton_interpret():
            raise SystemExit("--dry-run runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
        shapes = ExpertShapes(4, min(2, shapes.top_k), 64, 32, shapes.biased, shapes.activation)
        for tokens in args.tokens:
            for block_m in args.block_m or [None]:
                w4a8, bf16 = check(Workload(shapes, tokens, "cpu", block_m))
                tiles = f", {block_m}-slot tiles" if block_m else ""
                print(f"{name} toy, {tokens} tokens{tiles}: rel err grouped W4A8 {w4a8:.1e}, "
                      f"bf16 grouped {bf16:.1e}")
        return
    print("| model | tokens | path | gate_up us | down us | total us |")
    print("|---|---|---|---|---|---|")
    gate_up, down = dense_ceiling_us(shapes)
    print(f"| {name} | 1 | dense W4A8 over the top_k experts' bytes | {gate_up:.1f} | {down:.1f} | "
          f"{gate_up + down:.1f} |", flush=True)
    for tokens in args.tokens:
        chosen = grouped.moe_block_m(tokens * shapes.top_k, shapes.experts)
        rows = []
        for block_m in args.block_m or [None]:
            workload = Workload(shapes, tokens, "cuda", block_m)
            label = "grouped W4A8" if block_m is None else \
                f"grouped W4A8, {block_m}-slot tiles{' (chosen)' if block_m == chosen else ''}"
            rows.append((label, w4a8_us(workload)))
        rows.append(("bf16 torch._grouped_mm", bf16_us(workload)))
        del workload
        for path, (gate_up, down) in rows:
            print(f"| {name} | {tokens} | {path} | {gate_up:.1f} | {down:.1f} | {gate_up + down:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
