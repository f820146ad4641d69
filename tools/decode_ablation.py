"""What each small kernel of a decode step costs: the step time with kernels replaced by stubs that
launch nothing (outputs garbage, timing valid), the ceiling of any fusion that would remove them.
Measured in one engine, CUDA graphs re-captured per variant (bench/RESULTS.md, sixth session part 3).

    python3 tools/decode_ablation.py [--model synthetic:llama-3.1-8b] [--quantization mxfp4] \
        [--batches 1 64] [--variants base norm silu attn norm+silu+attn base]

Variants: `base` (nothing removed), or `+`-joined names of what to remove:
  norm   the residual add + RMSNorm (+ fp8 quantize) launches (two per layer)
  silu   the SiLU-mul (+ fp8 quantize) launch; with the SiLU in the gate_up GEMM's epilogue
         (KernelConfig.fuse_glu), the quantize launch after that GEMM
  attn   the whole attention (rotary, KV store, split, merge + quantize)
  rotary the rotary + KV store launch before the attention kernels (batches below FUSED_ROTARY_MIN_BATCH,
         where the split kernel does not rotate itself)
Repeat `base` last to see the run-to-run drift. On the CPU (`--device cpu`) it is a dry run of the
harness: eager steps, no graphs, timings meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import radiance.kernels.w4a8 as w4a8_module
import radiance.layers.norm as norm_module
import radiance.models.llama as llama_module
from radiance.bench.engine_bench import _engine, _random_ids, _sync
from radiance.engine.sampling_params import SamplingParams
from radiance.kernels.activation import Fp8Activations, fp8_outputs
from radiance.kernels.norm import PartialSums
from radiance.layers.attention import Attention
from radiance.layers.rotary import RotaryEmbedding

REMOVABLE = ("norm", "silu", "attn", "rotary")


def _no_norm(x, residual, weight, eps, quantize=False, keep_values=False, launch="norm"):
    if isinstance(x, PartialSums):  # a deferring GEMM's partials: an empty stand-in (a slice + cast would launch)
        x = torch.empty(*x.lead, x.width, dtype=x.dtype, device=x.parts.device)
    k = x.shape[-1]
    y = (Fp8Activations(*fp8_outputs(x.numel() // k, k, x.device), x.dtype, tuple(x.shape[:-1]),
                        x if keep_values else None) if quantize else x)
    return y, x


def _no_glu(gate_up, activation, quantize=False, *, bias=None, row_expert=None):
    inter = gate_up.shape[-1] // 2
    if not quantize:
        return gate_up[..., :inter]
    return Fp8Activations(*fp8_outputs(gate_up.numel() // gate_up.shape[-1], inter, gate_up.device), gate_up.dtype,
                          tuple(gate_up.shape[:-1]))


def _no_parts_quantize(y, amax_parts, launch="parts_quantize"):
    return fp8_outputs(y.shape[0], y.shape[1], y.device)


def _no_attention(self, q, k, v, meta, rotary=None, quantize=False, qk_norm=None, sinks=None):
    rows, width = q.shape[0], self.num_heads * self.head_dim
    if quantize:
        return Fp8Activations(*fp8_outputs(rows, width, q.device), q.dtype, (rows,))
    return q.reshape(rows, width)


def _no_rotary(self, positions, q, k, v, k_cache, v_cache, slot_mapping, scales=None, qk_norm=None, q_out=None):
    return q if q_out is None else q_out  # a copy into q_out would launch


@contextlib.contextmanager
def removed(names: set[str]):
    """Stubs in place of the named kernels' launchers while inside."""
    unknown = names - set(REMOVABLE)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; removable: {', '.join(REMOVABLE)}")
    saved = (norm_module.add_rmsnorm, llama_module.glu_mul, w4a8_module.quantize_rows_from_parts, Attention.forward,
             RotaryEmbedding.rotate_and_store)
    try:
        if "norm" in names:
            norm_module.add_rmsnorm = _no_norm
        if "silu" in names:
            llama_module.glu_mul = _no_glu
            w4a8_module.quantize_rows_from_parts = _no_parts_quantize
        if "attn" in names:
            Attention.forward = _no_attention
        if "rotary" in names:
            RotaryEmbedding.rotate_and_store = _no_rotary
        yield
    finally:
        (norm_module.add_rmsnorm, llama_module.glu_mul, w4a8_module.quantize_rows_from_parts,
         Attention.forward, RotaryEmbedding.rotate_and_store) = saved


def step_ms(engine, batch: int, gen, context: int = 128, steps: int = 24) -> float:
    """Wall ms per decode step of `batch` sequences at about `context` tokens, after their prefill and
    a few warm-up steps."""
    vocab = engine.model.config.vocab_size
    for i in range(batch):
        engine.add_request(f"ablation{i}", _random_ids(context, vocab, gen),
                           SamplingParams(max_tokens=steps + 6, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    _sync()
    t0, done = time.perf_counter(), 0
    while engine.has_unfinished_requests() and done < steps:
        engine.step()
        done += 1
    _sync()
    elapsed = (time.perf_counter() - t0) / max(done, 1) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def ab_engine(model: str, quantization: str, batches, device: str, overrides: dict | None = None):
    """The engine an in-engine A/B runs in: decode graphs for every batch, no prefill graphs."""
    return _engine(model, quantization, 4096, device, overrides, max_num_batched_tokens=8192,
                   max_num_seqs=max(8, *batches), gpu_memory_utilization=0.6, prefill_graph_tokens=())


def recapture(engine) -> None:
    """Re-capture the decode graphs: they bake in whatever launches (and constexprs) are in force now."""
    if engine.runner.decode_graphs:
        engine.runner.capture_decode_graphs()


def alternate(engine, module, name: str, values, batches, repeats: int, steps: int,
              log) -> list[tuple[object, list[float]]]:
    """[(value, [best-of-2 ms per decode step for each batch])] in run order: `module.name` set to each of
    `values` in turn, the decode graphs re-captured for each, the whole list alternated `repeats` times; log(value,
    times) after each. The setting and the graphs are restored after."""
    gen = torch.Generator().manual_seed(0)
    saved = getattr(module, name)
    rows = []
    try:
        for _ in range(repeats):
            for value in values:
                setattr(module, name, value)
                recapture(engine)
                rows.append((value, [min(step_ms(engine, b, gen, steps=steps) for _ in range(2)) for b in batches]))
                log(value, rows[-1][1])
    finally:
        setattr(module, name, saved)
        recapture(engine)  # leave the engine as it was
    return rows


def run(model: str, quantization: str, batches, variants, device: str = "cuda", overrides: dict | None = None,
        steps: int = 24) -> list[tuple[str, list[float]]]:
    engine = ab_engine(model, quantization, batches, device, overrides)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for variant in variants:
        names = set() if variant == "base" else set(variant.split("+"))
        with removed(names):
            recapture(engine)
            rows.append((variant, [step_ms(engine, b, gen, steps=steps) for b in batches]))
        print(f"{variant}: " + ", ".join(f"batch {b} {ms:.3f} ms" for b, ms in zip(batches, rows[-1][1])), flush=True)
    recapture(engine)  # leave the engine as it was
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--variants", nargs="+", default=["base", "norm", "silu", "attn", "norm+silu+attn", "base"])
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    rows = run(args.model, args.quantization, args.batches, args.variants, args.device)
    print("removed | " + " | ".join(f"batch {b} ms" for b in args.batches))
    for variant, times in rows:
        print(f"{variant} | " + " | ".join(f"{t:.3f}" for t in times))


if __name__ == "__main__":
    main()
