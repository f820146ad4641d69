"""Decode step ms vs the split-KV attention's CTA target (model_runner._TARGET_DECODE_CTAS), per batch."""
import sys, time, torch
import radiance.engine.model_runner as mr
sys.path.insert(0, "tools")
from decode_ablation import step_ms
from radiance.bench.engine_bench import _engine

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
OVERRIDES = None
if DEVICE == "cpu":
    sys.path.insert(0, "."); from tests.bench.test_bench_synthetic import TINY; OVERRIDES = dict(TINY, vocab_size=1024)
targets = [264, 1056, 528, 2112, 264]
for quant in ("mxfp4", "none"):
    engine = _engine("synthetic:llama-3.1-8b", quant, 4096, DEVICE, OVERRIDES, max_num_batched_tokens=8192,
                     max_num_seqs=64, gpu_memory_utilization=0.6, prefill_graph_tokens=())
    gen = torch.Generator().manual_seed(0)
    for t in targets:
        mr._TARGET_DECODE_CTAS = t
        if engine.runner.graphs:
            engine.runner._capture_decode_graphs()
        res = []
        for batch, ctx in ((64, 128), (64, 512), (32, 128), (16, 128), (8, 128)):
            res.append(f"b{batch}@{ctx} {step_ms(engine, batch, gen, context=ctx, steps=24):.3f}")
            res[-1] += f" (splits {mr.decode_num_splits(batch, 8)})"
        print(f"{quant} target {t}: " + ", ".join(res), flush=True)
    del engine
    torch.cuda.empty_cache()
