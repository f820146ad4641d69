"""Per-CTA timeline of the W4A8 GEMM: when each CTA starts (after its PDL wait), leaves its K loop and
ends, on which SM, with how many K tiles. Shows what a single time hides: the ramp, the SMs that
hold one CTA more than others and finish last, the split-K epilogue (bench/RESULTS.md, fifth session).

    python3 tools/gemm_cta_trace.py [--shapes 4096x14336 28672x4096] [--m 1 64]      # on the GPU

The traced kernel is the production one (_triton/gemm.py) with timestamps patched into a copy; the
launch goes through w4a8_gemm, so the tuning table, split count and PDL are the served ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
GEMM_SOURCE = ROOT / "radiance/kernels/_triton/gemm.py"
MAX_CTAS = 1 << 16
FIELDS = 8  # t_start, t_loop, t_end (globaltimer ns), smid, K tiles, c_start, c_loop, c_end (clock64)

_NOW = 'tl.inline_asm_elementwise("mov.u64 $0, %{};", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
# (anchor, text inserted before it); each anchor must occur exactly once in gemm.py
_PATCHES = (
    ("PDL_PREFETCH: tl.constexpr = 0):", None),  # replaced below: the signature gains trace_ptr
    ("    if SWAP_AB:\n        acc = tl.zeros(",
     f"    t_start = {_NOW.format('globaltimer')}\n    c_start = {_NOW.format('clock64')}\n"),
    ("    rm = pid_m * BM + tl.arange(0, BM)\n",
     f"    t_loop = {_NOW.format('globaltimer')}\n    c_loop = {_NOW.format('clock64')}\n"),
)
_EPILOGUE = f"""
    t_end = {_NOW.format('globaltimer')}
    c_end = {_NOW.format('clock64')}
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    slot = trace_ptr + (pid_k * tl.num_programs(0) + pid).to(tl.int64) * {FIELDS}
    tl.store(slot + 0, t_start)
    tl.store(slot + 1, t_loop)
    tl.store(slot + 2, t_end)
    tl.store(slot + 3, smid.to(tl.int64))
    tl.store(slot + 4, (kt_end - kt_begin).to(tl.int64))
    tl.store(slot + 5, c_start)
    tl.store(slot + 6, c_loop)
    tl.store(slot + 7, c_end)
"""


def traced_source(source: str) -> str:
    """gemm.py with timestamps; raises if an anchor moved (then update _PATCHES)."""
    for anchor, insert in _PATCHES:
        if source.count(anchor) != 1:
            raise RuntimeError(f"gemm_cta_trace: anchor {anchor!r} found {source.count(anchor)} times in {GEMM_SOURCE}")
        if insert is None:
            source = source.replace(anchor, anchor[:-2] + ", trace_ptr=None):")
        else:
            source = source.replace(anchor, insert + anchor)
    return source.rstrip("\n") + "\n" + _EPILOGUE


def load_traced_kernel():
    """Import the patched copy as a module (Triton's JIT needs a real file)."""
    path = Path(tempfile.mkdtemp(prefix="radiance-trace-")) / "traced_gemm.py"
    path.write_text(traced_source(GEMM_SOURCE.read_text()))
    spec = importlib.util.spec_from_file_location("radiance_traced_gemm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.w4a8_gemm_kernel


class _WithTrace:
    """Stands in for the GEMM kernel object in w4a8.py: kernel[grid](...) with trace_ptr added."""

    def __init__(self, kernel, buffer):
        self.kernel, self.buffer = kernel, buffer

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, trace_ptr=self.buffer, **kwargs)


def summarize(trace, label: str) -> list[str]:
    import numpy as np

    t0 = trace[:, 0].min()
    start, loop, end = ((trace[:, i] - t0) / 1e3 for i in range(3))
    sm = trace[:, 3].astype(int)
    per_sm = np.bincount(sm, minlength=sm.max() + 1)
    last = np.zeros(len(per_sm))
    np.maximum.at(last, sm, end)
    cycles = (trace[:, 6] - trace[:, 5]) / np.maximum(trace[:, 4], 1)
    q = lambda a: f"p50 {np.median(a):.2f} p90 {np.percentile(a, 90):.2f} max {a.max():.2f}"  # noqa: E731
    lines = [f"== {label}: {len(trace)} CTAs, {per_sm.min()}-{per_sm.max()} per SM, makespan {end.max():.2f} us",
             f"   start after PDL wait: {q(start)}",
             f"   K loop (own start to loop end): {q(loop - start)}",
             f"   epilogue (split-K sum included): {q(end - loop)}",
             f"   clock cycles per K tile per CTA: p10 {np.percentile(cycles, 10):.0f} p50 {np.median(cycles):.0f} "
             f"p90 {np.percentile(cycles, 90):.0f}"]
    for count in np.unique(per_sm[per_sm > 0]):
        sel = per_sm == count
        lines.append(f"   SMs holding {count} CTAs: {sel.sum()}, their last CTA ends at p50 "
                     f"{np.median(last[sel]):.2f} max {last[sel].max():.2f} us")
    return lines


def main(argv=None) -> int:
    import torch

    from radiance.bench.kernels import ShapeOperands
    from radiance.kernels import w4a8
    from radiance.kernels.activation import quantize_activations
    from radiance.kernels.timing import time_us

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4096x14336", "28672x4096", "6144x4096", "4096x4096"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 64])
    args = p.parse_args(argv)
    device = torch.device("cuda")
    kernel = load_traced_kernel()
    buffer = torch.zeros(MAX_CTAS * FIELDS, dtype=torch.int64, device=device)
    shim = types.SimpleNamespace(w4a8_gemm_kernel=_WithTrace(kernel, buffer))
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        ops = ShapeOperands(n, k, device, with_reference=False)
        for m in args.m:
            x_q, x_scale = quantize_activations(torch.randn(m, k, device=device, dtype=torch.bfloat16))
            plain = time_us([lambda w=w: w4a8.w4a8_gemm(x_q, x_scale, w, config=None) for w in ops.mx])
            buffer.zero_()
            with mock.patch.object(w4a8, "_gemm", shim):
                traced = time_us([lambda w=w: w4a8.w4a8_gemm(x_q, x_scale, w) for w in ops.mx])
            rows = buffer.view(MAX_CTAS, FIELDS).cpu().numpy()
            rows = rows[rows[:, 0] > 0]  # the CTAs of the last replayed launch wrote their slots
            cfg = w4a8.select_config(m, n, k, 64, device)
            label = (f"{shape} M={m} ({cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_stages} stages): "
                     f"{plain:.2f} us plain, {traced:.2f} us traced")
            print("\n".join(summarize(rows, label)), flush=True)
        del ops
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
