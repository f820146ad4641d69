"""Timeline of one decode step of a synthetic model on the GPU: per kernel name, the count, the summed
device time and the summed gap before it (negative where PDL overlaps a kernel with the one before),
from the profiler's device timestamps of one profiled step (overlap off, so a step is one burst).

    python3 tools/decode_timeline.py [--quantization mxfp4|none] [--batch 1] [--context 128]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from radiance.bench.engine_bench import _decode_ms, _engine, _random_ids, _sync
from radiance.engine.sampling_params import SamplingParams


def _steps(events, gap_us: float = 200.0):
    """Device events split into bursts (one per engine step) at host-side gaps."""
    events = sorted(events, key=lambda e: e.time_range.start)
    bursts, cur = [], [events[0]]
    for a, b in zip(events, events[1:]):
        if b.time_range.start - a.time_range.end > gap_us:
            bursts.append(cur)
            cur = []
        cur.append(b)
    bursts.append(cur)
    return bursts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--quantization", default="mxfp4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    args = p.parse_args()
    engine = _engine(args.model, args.quantization, max(4096, 2 * args.context), "cuda", None,
                     max_num_batched_tokens=max(2048, args.context), max_num_seqs=max(8, args.batch),
                     gpu_memory_utilization=0.6)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    if args.batch == 1:
        print("decode ms (overlap on):", round(_decode_ms(engine, args.context, 32, gen), 3), flush=True)
    engine.overlap_decode = False
    for i in range(args.batch):
        engine.add_request(f"prof{i}", _random_ids(args.context, vocab, gen),
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill (chunked if need be) and warm-up decode steps
        engine.step()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            engine.step()
            _sync()
    events = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    step = max(_steps(events)[:-1] or _steps(events), key=len)
    span = step[-1].time_range.end - step[0].time_range.start
    durs, gaps, counts = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
    prev_end = None
    for e in step:
        name = e.name[:60]
        gaps[name] += (e.time_range.start - prev_end) if prev_end is not None else 0.0
        durs[name] += e.time_range.elapsed_us()
        counts[name] += 1
        prev_end = max(prev_end or 0.0, e.time_range.end)
    print(f"{args.model} {args.quantization} batch {args.batch} context {args.context}: step span {span:.1f} us, "
          f"kernel sum {sum(durs.values()):.1f} us, {len(step)} kernels")
    print("count  device us  gap us  kernel")
    for name, d in sorted(durs.items(), key=lambda kv: -kv[1]):
        print(f"{counts[name]:5d} {d:10.1f} {gaps[name]:7.1f}  {name}")


if __name__ == "__main__":
    main()
