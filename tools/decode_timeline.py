"""Timeline of one batch-1 decode step of synthetic llama-3.1-8b (MXFP4 unless argv[1] names another
quantization): per kernel name, the count, the summed duration and the summed gap before it (negative
under PDL overlap), from the profiler's device timestamps:  python3 tools/decode_timeline.py [none]"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from radiance.bench.engine_bench import _engine, _random_ids, _sync, _decode_ms
from radiance.engine.sampling_params import SamplingParams

quant = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
engine = _engine("synthetic:llama-3.1-8b", quant, 4096, "cuda", None, max_num_batched_tokens=2048, max_num_seqs=8,
                 gpu_memory_utilization=0.5)
gen = torch.Generator().manual_seed(0)
print("decode ms (overlap on):", _decode_ms(engine, 128, 32, gen), flush=True)
engine.overlap_decode = False
print("decode ms (overlap off):", _decode_ms(engine, 128, 32, gen), flush=True)
engine.add_request("prof", _random_ids(128, engine.model.config.vocab_size, gen),
                   SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
engine.step(); engine.step(); engine.step()
_sync()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(4):
        engine.step()
        _sync()
ev = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
ev.sort(key=lambda e: e.time_range.start)
# split into steps at gaps > 200 us
steps, cur = [], [ev[0]]
for a, b in zip(ev, ev[1:]):
    if b.time_range.start - a.time_range.end > 200:
        steps.append(cur); cur = []
    cur.append(b)
steps.append(cur)
print("steps found:", len(steps), [len(s) for s in steps])
step = max(steps[:-1] or steps, key=len)
t0 = step[0].time_range.start
span = step[-1].time_range.end - t0
dur = sum(e.time_range.elapsed_us() for e in step)
gaps = collections.defaultdict(float); durs = collections.defaultdict(float); cnt = collections.Counter()
prev_end = None
lines = []
for e in step:
    name = e.name[:60]
    g = (e.time_range.start - prev_end) if prev_end is not None else 0.0
    gaps[name] += g; durs[name] += e.time_range.elapsed_us(); cnt[name] += 1
    lines.append(f"{e.time_range.start - t0:9.1f} gap {g:6.2f} dur {e.time_range.elapsed_us():7.2f} {name}")
    prev_end = max(prev_end or 0, e.time_range.end)
print(f"step span {span:.1f} us, kernel sum {dur:.1f} us, kernels {len(step)}")
print("first 40 kernels of the step:")
print("\n".join(lines[:24]))
print("per kernel name: count, total dur, total gap before it")
for name, d in sorted(durs.items(), key=lambda kv: -kv[1]):
    print(f"{cnt[name]:4d} {d:9.1f} {gaps[name]:9.1f}  {name}")
