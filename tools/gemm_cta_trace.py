"""Per-CTA timeline of the W4A8 GEMM: when each CTA starts (after its PDL wait), leaves its K loop and
ends, on which SM, with how many K tiles. Shows what a single time hides: the ramp, the SMs that
hold one CTA more than others and finish last, the split-K epilogue (bench/RESULTS.md, fifth session).

    python3 tools/gemm_cta_trace.py [--shapes 4096x14336 28672x4096] [--m 1 64]      # on the GPU
    python3 tools/gemm_cta_trace.py --engine synthetic:llama-3.1-8b                  # inside decode steps

With --engine the GEMMs are traced where they really run: in the engine's batch-1 decode CUDA graph,
each a programmatic dependent of a small kernel. It prints the step's GEMMs per shape and the gaps
between them.

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
# (anchor, text that replaces it): the kernel and its tile function (where the epilogue below lands, at the end of
# gemm.py) gain trace_ptr; each anchor must occur exactly once in gemm.py
_REPLACEMENTS = (
    ("DEFER_SUM: tl.constexpr = False, ACT: tl.constexpr = 0):",
     "DEFER_SUM: tl.constexpr = False, ACT: tl.constexpr = 0, trace_ptr=None):"),
    ("PDL_PREFETCH, GLU, DEFER_SUM, ACT)", "PDL_PREFETCH, GLU, DEFER_SUM, ACT, trace_ptr)"),
    ("ACT: tl.constexpr):", "ACT: tl.constexpr, trace_ptr):"),
)
# (anchor, text inserted before it); each anchor must occur exactly once in gemm.py
_PATCHES = (
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
    """gemm.py with timestamps; raises if an anchor moved (then update _REPLACEMENTS / _PATCHES)."""
    edits = list(_REPLACEMENTS) + [(anchor, insert + anchor) for anchor, insert in _PATCHES]
    for anchor, text in edits:
        if source.count(anchor) != 1:
            raise RuntimeError(f"gemm_cta_trace: anchor {anchor!r} found {source.count(anchor)} times in {GEMM_SOURCE}")
        source = source.replace(anchor, text)
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
    """Stands in for the GEMM kernel object in w4a8.py (which launches through kernel.run(..., grid=, warmup=)):
    the same calls with trace_ptr added."""

    def __init__(self, kernel, buffer):
        self.kernel, self.buffer = kernel, buffer

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        return self.kernel.run(*args, grid=grid, warmup=warmup, trace_ptr=self.buffer, **kwargs)


class _PerCallTrace:
    """Like _WithTrace, but every launch gets its own zeroed slots, kept alive here: the launches baked
    into a CUDA graph keep theirs, so after replays each holds the timeline of its last replay."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls = []  # (m, n, k, captured into a graph, slots)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        """A launch (its slots recorded), or with warmup=True the lookup of the compiled kernel the launch with
        these arguments runs (w4a8 caps its occupancy inside graphs through it)."""
        import torch

        slots = torch.zeros(grid[0] * grid[1] * FIELDS, dtype=torch.int64, device=args[0].device)
        if not warmup:
            first = self.kernel.arg_names.index("M")  # M, N, K follow the kernel's tensors
            m, n, k = args[first:first + 3]
            self.calls.append((m, n, k, torch.cuda.is_current_stream_capturing(), slots))
        return self.kernel.run(*args, grid=grid, warmup=warmup, trace_ptr=slots, **kwargs)


def step_summary(calls) -> list[str]:
    """calls: [(n, k, trace [CTAs, FIELDS])] of one step in launch order -> per-shape lines and the
    gaps between GEMMs (a gap: the previous GEMM's last CTA end to this one's first CTA start)."""
    import numpy as np

    t0 = min(int(t[:, 0].min()) for _, _, t in calls)
    spans = [((t[:, 0].min() - t0) / 1e3, (t[:, 2].max() - t0) / 1e3) for _, _, t in calls]
    gaps = [spans[i][0] - spans[i - 1][1] for i in range(1, len(spans))]
    lines = [f"== {len(calls)} GEMMs: first start to last end {spans[-1][1] - spans[0][0]:.1f} us; "
             f"in GEMMs {sum(e - b for b, e in spans):.1f} us; between them {sum(max(g, 0.0) for g in gaps):.1f} us"]
    for shape in dict.fromkeys((n, k) for n, k, _ in calls):
        idx = [i for i, (n, k, _) in enumerate(calls) if (n, k) == shape]
        makespan = np.array([spans[i][1] - spans[i][0] for i in idx])
        before = np.array([gaps[i - 1] for i in idx if i > 0])
        counts = [np.bincount(calls[i][2][:, 3].astype(int)) for i in idx]
        tails = np.array([(t[:, 2].max() - np.median(t[:, 2])) / 1e3 for t in (calls[i][2] for i in idx)])
        lines.append(f"   {shape[0]}x{shape[1]}: {len(idx)} calls, {len(calls[idx[0]][2])} CTAs, makespan p50 "
                     f"{np.median(makespan):.2f} us, last CTA after the median one by p50 {np.median(tails):.2f} us, "
                     f"CTAs per SM up to {max(int(c.max()) for c in counts)}"
                     + (f", gap before p50 {np.median(before):.2f} us" if len(before) else ""))
    return lines


def trace_engine(model: str, context: int = 128, steps: int = 16, device: str = "cuda",
                 overrides: dict | None = None) -> list[str]:
    """Batch-1 decode with every W4A8 GEMM traced inside the engine's CUDA graph (`device`, `overrides`:
    a CPU dry run of the harness with a tiny config, which captures nothing and says so)."""
    import torch

    from radiance.bench.engine_bench import _engine, _random_ids
    from radiance.engine.sampling_params import SamplingParams
    from radiance.kernels import w4a8

    tracer = _PerCallTrace(load_traced_kernel())
    with mock.patch.object(w4a8, "_gemm", types.SimpleNamespace(w4a8_gemm_kernel=tracer)):
        engine = _engine(model, "mxfp4", context + steps + 64, device, overrides, max_num_seqs=1,
                         cuda_graph_max_batch=1)
        gen = torch.Generator().manual_seed(0)
        engine.add_request("traced", _random_ids(context, engine.model.config.vocab_size, gen),
                           SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
    step = [(n, k, slots.view(-1, FIELDS).cpu().numpy()) for m, n, k, captured, slots in tracer.calls
            if captured and m == 1]
    if not step:
        raise RuntimeError("no W4A8 GEMM was captured into the batch-1 decode graph (is the model MXFP4 on sm_90?)")
    return [f"engine {model}, batch-1 decode at context {context}, the graph's last replay:"] + step_summary(step)


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
    p.add_argument("--engine", metavar="MODEL", help="trace the GEMMs inside the engine's batch-1 decode steps "
                                                    "instead (e.g. synthetic:llama-3.1-8b)")
    args = p.parse_args(argv)
    if args.engine:
        print("\n".join(trace_engine(args.engine)), flush=True)
        return 0
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
