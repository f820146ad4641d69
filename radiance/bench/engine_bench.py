"""Offline engine speed on the GPU: a random-weight model with a real config (no download).

Measures, per variant (bf16, MXFP4): batch-1 decode ms/step at two context depths, prefill tok/s at two
prompt lengths (and, for the shortest, the share of the step the GPU spends in kernels: below ~0.8 the
prefill is host-bound), aggregate output tok/s at several concurrencies, and the batch-1 decode step time
against the sum of its kernels' device times (engine overhead), with the kernels that keep the GPU busy
longest per step; then HF transformers `generate` in bf16
on the same config as the peer. Everything is measured in one process, side by side.
`python -m radiance.bench.engine_bench --model synthetic:llama-3.1-8b` (or `radiance bench engine`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time

import torch

from radiance.bench.options import add_engine_options
from radiance.bench.quality import split_suffixes
from radiance.bench.report import check_output_path, format_table
from radiance.bench.synthetic import SyntheticCheckpoint, synthetic_config
from radiance.config import ModelConfig
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture

logger = logging.getLogger(__name__)

DECODE_STEPS = 32  # timed batch-1 decode steps per context depth
# tokens a decode measurement generates past its depth: the timed steps, the first token and two warm-up steps
DECODE_ROOM = DECODE_STEPS + 3
HEADROOM = 256  # tokens of context asked past the deepest measurement, where the model's context has them


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _random_ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()


def _engine(model: str, quantization: str, max_model_len: int, device: str, overrides: dict | None, **options):
    from radiance.config import EngineConfig
    from radiance.engine.llm_engine import LLMEngine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ckpt = SyntheticCheckpoint(model, device=device, dtype=dtype, overrides=overrides)
    config = EngineConfig.from_flat(model=model, quantization=quantization, max_model_len=max_model_len,
                                    device=device, **options)
    return LLMEngine(config, checkpoint=ckpt, progress=False)


def _decode_ms(engine, context: int, steps: int, gen) -> float:
    """Wall ms per batch-1 decode step with `context` tokens in the cache: `steps` steps run back to
    back as a server runs them (no synchronization between steps, so a step queued ahead overlaps the
    host's work on the previous one), after the prefill (one step per max_num_batched_tokens chunk) and
    two warm-up steps."""
    from radiance.engine.sampling_params import SamplingParams

    vocab = engine.model.config.vocab_size
    engine.add_request("decode", _random_ids(context, vocab, gen),
                       SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True))
    while not any(out.token_ids for out in engine.step()):  # the prefill's chunks, up to its first token
        pass
    for _ in range(2):
        engine.step()
    _sync()
    t0 = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests():
        engine.step()
        done += 1
    _sync()
    if done != steps:  # the timed steps must all be decode steps (no prefill chunk among them)
        raise RuntimeError(f"decode timing ran {done} steps, expected {steps}")
    return (time.perf_counter() - t0) / done * 1e3


def _prefill_tok_s(engine, length: int, gen, repeats: int = 3) -> float:
    from radiance.engine.sampling_params import SamplingParams

    vocab = engine.model.config.vocab_size
    best = float("inf")
    for r in range(repeats + 1):
        engine.add_request(f"prefill{r}", _random_ids(length, vocab, gen), SamplingParams(max_tokens=1, temperature=0.0))
        _sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
        if r:  # the first is warm-up (Triton compiles for new shapes)
            best = min(best, time.perf_counter() - t0)
    return length / best


def _aggregate_tok_s(engine, concurrency: int, prompt_len: int, output_len: int, gen) -> float:
    from radiance.engine.sampling_params import SamplingParams

    vocab = engine.model.config.vocab_size
    # warm-up with the same batch shapes (Triton compiles kernels for shapes it has not seen, which
    # inside the timed run would cost seconds against a run of about one)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"warm{i}", _random_ids(prompt_len, vocab, gen), warm)
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"agg{i}", _random_ids(prompt_len, vocab, gen), params)
    _sync()
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(1 for o in engine.step() if o.token_ids)
    _sync()
    return produced / (time.perf_counter() - t0)


def kernel_breakdown(records, steps: int, top: int = 12) -> list[dict]:
    """Per-kernel totals of profiled steps: records are (kernel name, start us, end us) of device kernels;
    returns [{"kernel", "busy_us_per_step", "us_per_step", "calls_per_step"}] for the `top` kernels that add the
    most to the GPU's busy time. A kernel's busy share is the part of its intervals that no kernel started
    before it covers (the shares sum to busy_us). With programmatic dependent launch a kernel starts while the
    one before it runs and waits for it, so its own duration (us_per_step) counts that wait and overstates it."""
    totals: dict[str, list] = {}
    reach = float("-inf")
    for name, start, end in sorted(records, key=lambda r: (r[1], r[2])):
        entry = totals.setdefault(name, [0.0, 0.0, 0])
        if end > reach:
            entry[0] += end - max(start, reach)
            reach = end
        entry[1] += end - start
        entry[2] += 1
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:top]
    return [{"kernel": name[:80], "busy_us_per_step": busy / steps, "us_per_step": us / steps,
             "calls_per_step": calls / steps} for name, (busy, us, calls) in ranked]


def busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals: the time the GPU ran at least one kernel. A sum of
    kernel times overstates it once kernels overlap (PDL launches a kernel early, and its wait for the
    one before counts as its own time)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _device_events(prof) -> list:
    """The device-side records of a torch profile: kernels, memcpy/memset, graph-launched ones included."""
    return [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]


def _device_records(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each device-side record."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in _device_events(prof)]


def _intervals(records) -> list[tuple[float, float]]:
    return [(start, end) for _, start, end in records]


def _prefill_gpu_busy(engine, length: int, wall_s: float, gen) -> float:
    """The time the GPU runs kernels during one `length`-token prefill (the union of their intervals)
    over its unprofiled wall time `wall_s` (the profiler slows the host, so its own wall time would
    overstate the gaps). Well below 1: the step is host-bound, the GPU waits for launches
    (bench/RESULTS.md, fifth session: MXFP4 at 1k, 0.55 as a kernel-time sum). A prefill replayed
    from a CUDA graph can read above 1 (the profiled replay runs slower than the timed ones: 1.09 for
    the 8B's 512-token MXFP4 prefill); near or above ~0.9, the step is GPU-bound."""
    from torch.profiler import ProfilerActivity, profile

    from radiance.engine.sampling_params import SamplingParams

    engine.add_request("prefill-profiled", _random_ids(length, engine.model.config.vocab_size, gen),
                       SamplingParams(max_tokens=1, temperature=0.0))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
    return busy_us(_intervals(_device_records(prof))) / 1e6 / wall_s


def _kernel_sum_ms(engine, context: int, gen, steps: int = 8) -> tuple[float, float, float, list[dict]]:
    """(median step wall ms, mean per-step sum of CUDA kernel times, mean per-step time the GPU runs any
    kernel (busy_us), the kernels that add most to that busy time (kernel_breakdown)) over profiled batch-1
    decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from radiance.engine.sampling_params import SamplingParams

    vocab = engine.model.config.vocab_size
    engine.add_request("prof", _random_ids(context, vocab, gen),
                       SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True))
    overlap, engine.overlap_decode = engine.overlap_decode, False  # no step of the window queued outside it
    engine.step()
    engine.step()  # prefill, first decode
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _sync()
            t0 = time.perf_counter()
            engine.step()
            _sync()
            walls.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.overlap_decode = overlap
    records = _device_records(prof)
    kernel_us = sum(end - start for _, start, end in records)
    return (statistics.median(walls) * 1e3, kernel_us / steps / 1e3,
            busy_us(_intervals(records)) / steps / 1e3, kernel_breakdown(records, steps))


def bench_variant(model: str, quantization: str, contexts, prefills, concurrencies, max_model_len: int,
                  device: str = "cuda", overrides: dict | None = None, engine_options: dict | None = None) -> dict:
    gen = torch.Generator().manual_seed(0)
    options = dict(engine_options or {})
    quant, head, kv = split_suffixes(quantization)
    if kv != "auto":  # e.g. "mxfp4+fp8kv": an fp8 KV cache
        options["kv_cache_dtype"] = kv
    if head is not None:  # e.g. "mxfp4+head": the lm_head quantized too
        options.update(quantize_lm_head=True, lm_head_format=head)
    engine = _engine(model, quant, max_model_len, device, overrides, max_num_batched_tokens=max(prefills),
                     max_num_seqs=max(concurrencies), gpu_memory_utilization=0.85, **options)
    row = {"variant": quantization, "load": engine.load_summary}
    for c in contexts:
        row[f"decode_ms@{c}"] = _decode_ms(engine, c, DECODE_STEPS, gen)
    for p in prefills:
        row[f"prefill_tok_s@{p}"] = _prefill_tok_s(engine, p, gen)
    if device == "cuda":  # is the shortest prefill host-bound?
        p = min(prefills)
        row[f"prefill_gpu_busy@{p}"] = _prefill_gpu_busy(engine, p, p / row[f"prefill_tok_s@{p}"], gen)
    for n in concurrencies:
        row[f"agg_tok_s@{n}"] = _aggregate_tok_s(engine, n, 128, 128, gen)
    if device == "cuda":
        (row["profiled_step_ms"], row["kernel_sum_ms"], row["gpu_busy_ms"],
         row["kernels"]) = _kernel_sum_ms(engine, contexts[0], gen)
        # unprofiled step time over the time the GPU runs kernels (the profiler itself slows the host side)
        base = row[f"decode_ms@{contexts[0]}"]
        row["overhead_ratio"] = base / row["gpu_busy_ms"] if row["gpu_busy_ms"] else float("nan")
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.inference_mode()
def bench_hf(model: str, contexts, prefills, concurrencies) -> dict:
    """HF transformers (eager, its default) bf16 on the same config, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = SyntheticCheckpoint(model, device="cuda")
    config = AutoConfig.for_model(**{k: v for k, v in ckpt.config.items() if k != "architectures"})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config).eval()
    torch.set_default_dtype(old)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    row = {"variant": "hf-transformers-bf16"}

    def generate(batch, prompt_len, new):
        ids = torch.tensor([_random_ids(prompt_len, vocab, gen) for _ in range(batch)], device="cuda")
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t0

    for c in contexts:
        generate(1, c, 2)
        short, long = generate(1, c, 2), generate(1, c, 34)
        row[f"decode_ms@{c}"] = (long - short) / 32 * 1e3
    for p in prefills:
        ids = torch.tensor([_random_ids(p, vocab, gen)], device="cuda")
        hf(ids[:, :16])
        _sync()
        t0 = time.perf_counter()
        hf(ids, logits_to_keep=1)
        _sync()
        row[f"prefill_tok_s@{p}"] = p / (time.perf_counter() - t0)
    for n in concurrencies:
        row[f"agg_tok_s@{n}"] = n * 128 / generate(n, 128, 128)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return row


def run(model: str = "synthetic:llama-3.1-8b", variants=("none", "mxfp4"), contexts=(128, 8192),
        prefills=(1024, 8192), concurrencies=(16, 64), with_hf: bool = True, device: str = "cuda",
        overrides: dict | None = None, engine_options: dict | None = None) -> list[dict]:
    """`device="cpu"` with a small `overrides` config is a dry run of the harness (no timings that matter);
    `engine_options` go to every variant's EngineConfig (e.g. prefill_graph_tokens)."""
    if device == "cuda" and not torch.cuda.is_available():  # else every variant fails alike, each with a traceback
        raise ConfigError("bench engine measures a CUDA GPU, and torch sees none here")
    max_model_len = fit_max_model_len(model, overrides, contexts, prefills)
    rows = []
    for v in variants:
        rows.append(_guarded(v, bench_variant, model, v, contexts, prefills, concurrencies, max_model_len, device,
                             overrides, engine_options))
        print(table(rows), flush=True)
    if with_hf:
        rows.append(_guarded("hf-transformers-bf16", bench_hf, model, contexts, prefills, concurrencies))
    return rows


def fit_max_model_len(model: str, overrides: dict | None, contexts, prefills) -> int:
    """The engine's max_model_len: the deepest measurement plus HEADROOM, capped at the model's context (the
    engine refuses more); a depth whose measurement cannot fit the context is refused here, before any model is
    built, where it failed inside its variant."""
    context = resolve_architecture(synthetic_config(model, overrides))[1].context_length
    _check_depths("--contexts", contexts, DECODE_ROOM, model, context)
    _check_depths("--prefills", prefills, 1, model, context)  # the prompt, then its one token
    return min(max((*contexts, *prefills)) + HEADROOM, context)


def _check_depths(flag: str, depths, room: int, model: str, context: int) -> None:
    too_deep = [d for d in depths if d + room > context]
    if too_deep:
        raise ConfigError(f"{flag} {' '.join(map(str, too_deep))} does not fit {model}'s context of {context} "
                          f"tokens (the measurement needs {room} more past its depth): use {context - room} or less")


def _guarded(label: str, fn, *args) -> dict:
    """One failing variant must not lose the others' numbers."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the log
        logger.exception("benchmark %s failed", label)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"variant": label, "error": f"{type(exc).__name__}: {exc}"[:200]}


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("variant", "load", "error", "kernels")))
    return format_table(["variant"] + keys, [[r["variant"]] + [r.get(k) for k in keys] for r in rows],
                        digits=[0] + [2] * len(keys))


def check_args(model: str, args) -> None:
    """The arguments' own mistakes, before a variant builds minutes of random weights and fails on them."""
    synthetic_config(model)  # bench engine builds synthetic models only
    for variant in args.variants:
        quant, head, _ = split_suffixes(variant)
        try:  # the engine's own rules for the quantization and the lm_head
            ModelConfig(quantization=quant, quantize_lm_head=head is not None, lm_head_format=head or "mxfp4")
        except ValueError as exc:
            raise ConfigError(f"variant {variant!r}: {exc}") from None
    if args.json:
        check_output_path(args.json, "--json")


def run_args(args) -> int:
    model = args.model_arg or args.model or "synthetic:llama-3.1-8b"
    check_args(model, args)
    options = None
    if args.prefill_graphs is not None:
        options = {"prefill_graph_tokens": tuple(args.prefill_graphs)}
    rows = run(model, tuple(args.variants), tuple(args.contexts), tuple(args.prefills),
               tuple(args.concurrency), args.with_hf, engine_options=options)
    for r in rows:
        for line in r.get("load", []):
            print(f"[{r['variant']}] {line}")
    print(table(rows))
    for r in rows:
        for k in r.get("kernels", []):
            print(f"[{r['variant']}] decode step @{args.contexts[0]}: {k['busy_us_per_step']:8.1f} us busy "
                  f"({k['us_per_step']:8.1f} us own duration) {k['calls_per_step']:5.0f} calls  {k['kernel']}")
    for r in rows:
        if "error" in r:
            print(f"[{r['variant']}] FAILED: {r['error']}")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        except OSError as exc:  # checked before the run; the directory can still go away during it
            raise ConfigError(f"cannot write --json {args.json}: {exc}") from None
    return 1 if any("error" in r for r in rows) else 0  # a failed variant is a failed run for scripts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_options(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(run_args(parser.parse_args()))
