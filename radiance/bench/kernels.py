"""`radiance bench kernels`: correctness, tile sweep and speed of the W4A8 kernels on a GPU.

Measured side by side in one run, per (N x K, M): ours with activation quantization, our GEMM
alone, cuBLAS bf16 (torch.mm), cuBLAS fp8 rowwise (torch._scaled_mm), our reference path; times
from CUDA-graph replays with weights rotated past the L2. Also: the kernel vs the exact reference at
every M band, the PTX check for fp8 wgmma, and the NVFP4 -> MXFP4 requant time for an 8B model.
Runnable as `python -m radiance.bench.kernels`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import traceback
from typing import NamedTuple

import torch

from radiance.bench.options import add_kernels_options
from radiance.kernels import reference
from radiance.kernels.activation import quantize_activations
from radiance.kernels.prepare import dequantize_prepared, prepare_mxfp4
from radiance.kernels.timing import copies_to_rotate, time_us
from radiance.kernels.tuning import GemmConfig
from radiance.kernels.w4a8 import expand_weight_fp8, gemm_ptx, w4a8_gemm

log = logging.getLogger(__name__)

CHECK_M = (1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 128, 257, 1024, 4096)
CHECK_SHAPES = ((48, 96), (4104, 4096), (1024, 14336), (256, 288))
PREFILL_CANDIDATES = (  # --precision-probe: big-M tilings, each checked at K=14336 and timed
    GemmConfig(128, 128, 128, True, num_warps=8, num_stages=3, split_k=1),
    GemmConfig(128, 128, 128, False, num_warps=8, num_stages=3, split_k=1),
    GemmConfig(128, 128, 256, True, num_warps=8, num_stages=2, split_k=1),  # fp32 promotion every 256 of K
    GemmConfig(128, 128, 128, True, num_warps=8, num_stages=3, split_k=1, precise_acc=False),
    GemmConfig(128, 256, 128, False, num_warps=8, num_stages=3, split_k=1, precise_acc=False),
)
LLAMA_8B_LINEARS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate_up, down


def random_mxfp4(n: int, k: int, device, spread: int = 5, gen: torch.Generator | None = None):
    """Random codes and block exponents 2^-8 .. 2^(spread-8): realistic weight magnitudes."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.randint(119, 119 + spread + 1, (n, k // 32), dtype=torch.uint8, device=device, generator=gen)
    return packed, scale


def _fmt(v: float, digits: int = 1) -> str:
    return "-" if v != v else f"{v:.{digits}f}"


# ---------------------------------------------------------------- correctness


class Checked(NamedTuple):
    """A --check section's report lines and how many of its checks failed (the exit code reads this)."""
    lines: list[str]
    failures: int


def run_check(device, m_list=CHECK_M, shapes=CHECK_SHAPES, config: GemmConfig | None = None) -> Checked:
    """Kernel vs exact reference at every M (fresh inputs, poisoned outputs, bias on odd rows)."""
    lines, worst, failures = [], 0.0, 0
    for n, k in shapes:
        for i, m in enumerate(m_list):
            packed, scale = random_mxfp4(n, k, device)
            pw = prepare_mxfp4(packed, scale)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16) * 3
            bias = torch.randn(n, device=device, dtype=torch.bfloat16) if i % 2 else None
            x_q, x_scale = quantize_activations(x)
            out = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
            w4a8_gemm(x_q, x_scale, pw, bias, out=out, config=config)
            ref = reference.w4a8_reference(x, packed, scale, bias)  # bf16, like the kernel
            err = reference.relative_error(out, ref)
            worst = max(worst, err) if err == err else float("inf")
            ok = err <= 2e-3  # False for NaN too
            failures += not ok
            lines.append(f"check N={n} K={k} M={m} bias={bias is not None}: rel={err:.2e} {'ok' if ok else 'FAIL'}")
    lines.append(f"check worst rel error {worst:.2e} ({'FAIL' if failures else 'PASS'}, gate 2e-3)")
    return Checked(lines, failures)


def run_convert_check(device) -> Checked:
    """prmt (inline asm) and arithmetic expansion give identical bytes; both equal the exact weight."""
    packed, scale = random_mxfp4(640, 4096, device, spread=14)  # wide spread: exercises shifts and underflow
    pw = prepare_mxfp4(packed, scale)
    a = expand_weight_fp8(pw, use_asm=True).view(torch.uint8)
    b = expand_weight_fp8(pw, use_asm=False).view(torch.uint8)
    exact = dequantize_prepared(pw) / pw.w_scale[:, None]
    same = torch.equal(a, b)
    value_ok = torch.equal(a.view(torch.float8_e4m3fn).float(), exact)
    return Checked([f"convert prmt == arithmetic bytes: {same}; equals exact weight: {value_ok}; "
                    f"underflow blocks {pw.underflow_blocks}"], (not same) + (not value_ok))


def run_ptx_check(device) -> Checked:
    lines, failures = [], 0
    for m in (16, 4096):
        packed, scale = random_mxfp4(4096, 4096, device)
        pw = prepare_mxfp4(packed, scale)
        x_q, x_scale = quantize_activations(torch.randn(m, 4096, device=device))
        ptx = gemm_ptx(x_q, x_scale, pw)
        has = "wgmma" in ptx and "e4m3" in ptx and any("wgmma" in ln and "e4m3" in ln for ln in ptx.splitlines())
        failures += not has  # a missing prmt is reported, not failed: the arithmetic expansion is still right
        lines.append(f"ptx M={m}: fp8 e4m3 wgmma {'present' if has else 'ABSENT'}; prmt {'present' if 'prmt' in ptx else 'ABSENT'}")
    return Checked(lines, failures)


# ---------------------------------------------------------------- timing


class ShapeOperands:
    """Rotated copies of every operand one shape needs, for all variants."""

    def __init__(self, n: int, k: int, device, with_reference: bool):
        self.n, self.k = n, k
        w_bytes = n * k * 17 // 32
        copies = copies_to_rotate(n * k * 2)  # sized for the largest (bf16) weight
        self.mx = [prepare_mxfp4(*random_mxfp4(n, k, device)) for _ in range(copies_to_rotate(w_bytes))]
        base = [dequantize_prepared(self.mx[i % len(self.mx)]) for i in range(copies)]
        self.bf16 = [w.to(torch.bfloat16) for w in base]
        self.fp8, self.fp8_scale = [], []
        for w in base:
            s = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            self.fp8.append((w / s).to(torch.float8_e4m3fn))
            self.fp8_scale.append(s.t().contiguous().float())
        self.ref_w = base[0] if with_reference else None
        self.w_bytes = w_bytes


def time_shape(ops: ShapeOperands, m: int, device, decode_band: int, config: GemmConfig | None = None,
               variants=("ours", "gemm", "bf16", "fp8", "ref")) -> dict:
    k = ops.k
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    x_q, x_scale = quantize_activations(x)
    res = {}
    if "ours" in variants:
        res["ours"] = time_us([lambda w=w: w4a8_gemm(*quantize_activations(x), w, decode_band=decode_band, config=config)
                               for w in ops.mx])
    if "gemm" in variants:
        res["gemm"] = time_us([lambda w=w: w4a8_gemm(x_q, x_scale, w, decode_band=decode_band, config=config)
                               for w in ops.mx])
    if "bf16" in variants:
        res["bf16"] = time_us([lambda w=w: torch.mm(x, w.t()) for w in ops.bf16])
    if "fp8" in variants:
        mp = max(16, -(-m // 16) * 16)  # cuBLASLt fp8 wants M % 16 == 0: pad small M
        xp = torch.zeros(mp, k, device=device, dtype=torch.bfloat16)
        xp[:m] = x
        xq8, xs8 = reference.quantize_activations_reference(xp)
        try:
            res["fp8"] = time_us([lambda w=w, s=s: torch._scaled_mm(xq8, w.t(), scale_a=xs8, scale_b=s,
                                                                      out_dtype=torch.bfloat16)
                                  for w, s in zip(ops.fp8, ops.fp8_scale)])
        except Exception as exc:  # noqa: BLE001
            log.warning("fp8 _scaled_mm failed at M=%d: %s", m, exc)
            res["fp8"] = float("nan")
    if "ref" in variants and ops.ref_w is not None and m <= 256:  # fp64 on CUDA: slow above
        res["ref"] = time_us([lambda: reference.w4a8_matmul_reference(
            *reference.quantize_activations_reference(x), ops.ref_w, None, torch.bfloat16)], target_ms=20)
    return res


def bench_table(shapes, m_list, device, decode_band: int, with_reference: bool = True,
                config: GemmConfig | None = None) -> list[str]:
    header = ("| N x K | M | ours us | GEMM us | bf16 us | fp8 us | ref us | ours TFLOP/s | ours TB/s (4.25b) "
              "| x bf16 | x fp8 |")
    lines = [header, "|" + "---|" * 11]
    for n, k in shapes:
        ops = ShapeOperands(n, k, device, with_reference)
        for m in m_list:
            r = time_shape(ops, m, device, decode_band, config)
            ours = r["ours"]
            tflops = 2 * m * n * k / ours / 1e6
            tbs = ops.w_bytes / ours / 1e6
            lines.append(f"| {n}x{k} | {m} | {_fmt(ours)} | {_fmt(r['gemm'])} | {_fmt(r['bf16'])} | {_fmt(r['fp8'])} "
                         f"| {_fmt(r.get('ref', float('nan')))} | {_fmt(tflops)} | {_fmt(tbs, 2)} "
                         f"| {_fmt(r['bf16'] / ours, 2)} | {_fmt(r['fp8'] / ours, 2)} |")
            print(lines[-1], flush=True)
        del ops
        torch.cuda.empty_cache()
    return lines


# ---------------------------------------------------------------- sweep


def sweep_candidates(band: str) -> list[GemmConfig]:
    if band == "decode":
        # third session: block_n 64 / block_k 256 / 4 warps / 3-4 stages won nearly everywhere, 8 warps
        # never; the split count mattered most (1, 2, 5 or 9 by shape), so splits are swept around it
        cands = [GemmConfig(16, bn, bk, True, num_warps=4, num_stages=st, split_k=0)
                 for bn in (64, 128) for bk in (128, 256) for st in (3, 4)]
        cands.append(GemmConfig(16, 256, 128, True, num_warps=8, num_stages=3, split_k=0))
        # deeper pipelines: ncu shows 15% occupancy and 42% of DRAM peak at M=1, so more bytes in flight
        # per CTA is the next thing to try (not measured yet)
        cands += [GemmConfig(16, 64, 256, True, num_warps=4, num_stages=st, split_k=0) for st in (6, 8)]
        cands.append(GemmConfig(16, 64, 128, True, num_warps=4, num_stages=8, split_k=0))
        return cands + [GemmConfig(16, bn, 256, True, num_warps=4, num_stages=4, split_k=sk)
                        for bn in (64, 128) for sk in (1, 2, 3, 5, 8)]
    cands = []
    for bm, bn, bk, warps, stages in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 64, 128, 4, 3)):
        cands.append(GemmConfig(bm, bn, bk, False, num_warps=warps, num_stages=stages, split_k=1))
    # swap-AB: the expanded weights feed the MMA from registers (no shared-memory round trip)
    for bm, bn, bk, warps, stages in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 3),
                                      (64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (128, 128, 256, 8, 2)):
        cands.append(GemmConfig(bm, bn, bk, True, num_warps=warps, num_stages=stages, split_k=1))
    # split-K for M in the low hundreds, where a 128-tile grid does not fill 132 SMs
    cands += [GemmConfig(128, 128, 128, True, num_warps=8, num_stages=3, split_k=0),
              GemmConfig(64, 128, 128, True, num_warps=4, num_stages=3, split_k=0)]
    # without the per-tile fp32 promotion (~40% of the MMA time once compute-bound): short K may stay
    # inside the gate, which the sweep checks before timing
    cands += [GemmConfig(bm, 128, 128, True, num_warps=warps, num_stages=3, split_k=0, precise_acc=False)
              for bm, warps in ((64, 4), (128, 8))]
    return cands


def _sweep_error(ops: ShapeOperands, m: int, device, decode_band: int, cfg: GemmConfig) -> float:
    """A candidate's relative error against the exact reference on the shape's first weight copy."""
    x = torch.randn(m, ops.k, device=device, dtype=torch.bfloat16) * 3
    x_q, x_scale = quantize_activations(x)
    out = w4a8_gemm(x_q, x_scale, ops.mx[0], decode_band=decode_band, config=cfg)
    ref = reference.w4a8_matmul_reference(x_q, x_scale, dequantize_prepared(ops.mx[0]), None, torch.bfloat16)
    return reference.relative_error(out, ref)


def run_sweep(shapes, m_list, device, decode_band: int) -> list[str]:
    """Time every candidate config that passes the 2e-3 numerics gate; print the best per (shape, M)
    as tuning-table entries."""
    lines = []
    for n, k in shapes:
        ops = ShapeOperands(n, k, device, with_reference=False)
        for m in m_list:
            band = "decode" if m <= decode_band else "prefill"
            best = None
            for cfg in sweep_candidates(band):
                if cfg.swap_ab and band == "decode":
                    cfg = GemmConfig(**{**cfg.as_dict(), "block_m": max(16, min(256, 1 << (m - 1).bit_length()))})
                try:
                    err = _sweep_error(ops, m, device, decode_band, cfg)
                    if not err <= 2e-3:  # a faster config that breaks the numerics gate is no candidate
                        lines.append(f"sweep {n}x{k} M={m} {cfg.as_dict()}: rel error {err:.2e} > 2e-3, skipped")
                        continue
                    t = time_shape(ops, m, device, decode_band, cfg, variants=("gemm",))["gemm"]
                except Exception as exc:  # noqa: BLE001 - a config may not compile (shared memory)
                    lines.append(f"sweep {n}x{k} M={m} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                lines.append(f"sweep {n}x{k} M={m} {cfg.as_dict()}: {t:.1f} us  {2 * m * n * k / t / 1e6:.0f} TFLOP/s"
                             f"  rel {err:.1e}")
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best:
                entry = {"shape": f"{n}x{k}", "m_max": m, "config": best[1].as_dict()}
                lines.append(f"best {json.dumps(entry)}  # {best[0]:.1f} us")
            print("\n".join(lines[-3:]), flush=True)
        del ops
        torch.cuda.empty_cache()
    return lines


def run_precision_probe(device) -> list[str]:
    """Accuracy (M=1024, K=14336) and speed (28672x4096, M=4096) of the big-M tiling candidates."""
    lines = []
    ops = ShapeOperands(28672, 4096, device, with_reference=False)
    for cfg in PREFILL_CANDIDATES:
        try:
            check = run_check(device, m_list=(1024,), shapes=((1024, 14336),), config=cfg).lines[0]
            t = time_shape(ops, 4096, device, 64, cfg, variants=("gemm",))["gemm"]
            lines.append(f"probe {cfg.as_dict()}: {check.split(': ', 1)[1]}; 28672x4096 M=4096 {t:.0f} us "
                         f"{2 * 4096 * 28672 * 4096 / t / 1e6:.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"probe {cfg.as_dict()}: failed {type(exc).__name__}: {str(exc)[:150]}")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------- requant


def run_requant(device, layers: int = 32) -> list[str]:
    """NVFP4 -> MXFP4 (+ kernel layout) for Llama-3.1-8B-shaped linears (+ lm_head), on the GPU."""
    from radiance.formats import nvfp4_to_mxfp4

    shapes = [s for _ in range(layers) for s in LLAMA_8B_LINEARS] + [(128256, 4096)]
    params = sum(n * k for n, k in shapes)
    t_requant = t_prepare = 0.0
    for n, k in shapes:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        scale = (torch.rand(n, k // 16, device=device) * 400 + 8).to(torch.float8_e4m3fn)
        gscale = torch.tensor([448.0 * 6 / 0.05], device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mp, ms, _ = nvfp4_to_mxfp4(packed, scale, gscale)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        prepare_mxfp4(mp, ms)
        torch.cuda.synchronize()
        t_requant += t1 - t0
        t_prepare += time.perf_counter() - t1
    return [f"requant NVFP4->MXFP4: {len(shapes)} linears, {params / 1e9:.2f}B params: {t_requant:.2f} s "
            f"(target < 10 s); kernel-layout prepare {t_prepare:.2f} s"]


# ---------------------------------------------------------------- activation error on a real model


def run_activation_error(layers=(0, 14, 29), prompt: str | None = None, progress: bool = True) -> list[str]:
    """W4A8 vs W4A16 vs W4A4 output error against the bf16 layer, on SmolLM2 activations captured
    from the 16-bit model (any device; the CPU is enough). Same MXFP4 weights in all three."""
    from radiance.engine.llm import LLM
    from radiance.engine.sampling_params import SamplingParams
    from radiance.formats import dequantize_mxfp4, quantize_mxfp4
    from radiance.layers.linear import DenseLinear

    from radiance.config import EngineConfig

    config = EngineConfig.from_flat(quantization="none", device="cpu", dtype="float32", enforce_eager=True)
    llm = LLM.from_engine_config(config, progress=progress)
    captured = {}
    hooks = []
    for name, module in llm.engine.model.named_modules():
        if isinstance(module, DenseLinear) and any(f"layers.{i}." in name for i in layers):
            def grab(mod, inputs, _out, name=name):
                captured.setdefault(name, (inputs[0].detach().reshape(-1, mod.in_features), mod.weight.detach()))
            hooks.append(module.register_forward_hook(grab))
    text = prompt or ("The quick brown fox jumps over the lazy dog. Quantization maps weights to four bits, and "
                      "activations to eight bits, so the tensor cores of a Hopper GPU can run the product in fp8.")
    llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for h in hooks:
        h.remove()
    lines = ["| layer | tokens | W4A8 rel err | W4A16 rel err | W4A4 rel err | fp8 act. alone (W4A8 vs W4A16) "
             "| fp4 act. alone (W4A4 vs W4A16) |", "|---|---|---|---|---|---|---|"]
    for name, (x, w) in sorted(captured.items()):
        x16, w16 = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
        ref = x16 @ w16.t()  # the bf16 layer, accumulated in fp32
        packed, scale = quantize_mxfp4(w16)
        w_mx = dequantize_mxfp4(packed, scale)
        w4a8 = reference.w4a8_reference(x16, packed, scale)
        w4a16 = x16 @ w_mx.t()
        w4a4 = dequantize_mxfp4(*quantize_mxfp4(x16)) @ w_mx.t()
        errs = [reference.relative_error(o, ref) for o in (w4a8, w4a16, w4a4)]
        errs += [reference.relative_error(w4a8, w4a16), reference.relative_error(w4a4, w4a16)]
        lines.append(f"| {name} | {x.shape[0]} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    return lines


# ---------------------------------------------------------------- CLI


def run_kernels_bench(args: argparse.Namespace) -> int:
    if args.activation_error and args.no_table and not (args.check or args.sweep or args.requant):
        return _finish(run_activation_error(progress=not args.no_progress), args.out, printed=False, failures=0)
    if not torch.cuda.is_available():
        from radiance.errors import ConfigError
        raise ConfigError("radiance bench kernels needs a CUDA GPU (the CPU runs only the reference path); "
                          "on a CPU, --activation-error --no-table measures the activation error alone")
    device = torch.device("cuda")
    lines = [f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}"]
    print(lines[0], flush=True)
    sections = []  # each gives report lines, or Checked(lines, failures)
    if args.check:
        sections += [lambda: run_convert_check(device), lambda: run_ptx_check(device),
                     lambda: run_check(device, config=args.config)]
    if args.precision_probe:
        sections.append(lambda: run_precision_probe(device))
    if args.sweep:
        sections.append(lambda: run_sweep(args.shapes, args.m, device, args.decode_band))
    if not args.no_table:
        sections.append(lambda: bench_table(args.shapes, args.m, device, args.decode_band, not args.no_reference,
                                            args.config))
    if args.requant:
        sections.append(lambda: run_requant(device))
    if args.activation_error:
        sections.append(lambda: run_activation_error(progress=not args.no_progress))
    failures = 0
    for section in sections:
        try:
            out = section()
        except Exception:  # noqa: BLE001 - report and go on: one broken section must not hide the others
            out = ["section failed:\n" + traceback.format_exc()]
            failures += 1
        if isinstance(out, Checked):
            failures += out.failures
            out = out.lines
        lines += out
        print("\n".join(ln for ln in out if not ln.startswith(("sweep", "| "))), flush=True)
    return _finish(lines, args.out, printed=True, failures=failures)


def _finish(lines: list[str], out: str | None, printed: bool, failures: int) -> int:
    """Prints what is not printed yet, writes --out, and gives the exit code: 1 when a check or a section failed
    (scripts and CI read the code, not the table)."""
    if failures:
        lines = lines + [f"{failures} check(s) or section(s) failed"]
    if not printed:
        print("\n".join(lines), flush=True)
    elif failures:
        print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = add_kernels_options(argparse.ArgumentParser(prog="python -m radiance.bench.kernels", description=__doc__))
    return run_kernels_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
