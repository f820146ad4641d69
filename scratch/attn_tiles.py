"""Decode step ms vs the split-KV attention kernel's BLOCK_N / num_warps / num_stages, per batch."""
import sys, torch
import radiance.layers.attention_triton as at
sys.path.insert(0, "tools")
from decode_ablation import step_ms
from radiance.bench.engine_bench import _engine

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
OVERRIDES = None
if DEVICE == "cpu":
    sys.path.insert(0, "."); from tests.bench.test_bench_synthetic import TINY; OVERRIDES = dict(TINY, vocab_size=1024)
original = at._decode_split_kernel


class Override:
    def __init__(self, **kw):
        self.kw = kw

    def __getitem__(self, grid):
        launch = original[grid]
        return lambda *a, **k: launch(*a, **{**k, **self.kw})


variants = [dict(), dict(num_stages=3), dict(num_stages=4), dict(num_stages=3, BLOCK_N=32), dict(), dict(num_stages=3)]
for quant in ("mxfp4",):
    engine = _engine("synthetic:llama-3.1-8b", quant, 8448, DEVICE, OVERRIDES, max_num_batched_tokens=8192,
                     max_num_seqs=64, gpu_memory_utilization=0.8, prefill_graph_tokens=())
    gen = torch.Generator().manual_seed(0)
    for v in variants:
        at._decode_split_kernel = Override(**v)
        if engine.runner.graphs:
            engine.runner._capture_decode_graphs()
        res = [f"b{b}@{c} {step_ms(engine, b, gen, context=c, steps=24):.3f}"
               for b, c in ((1, 2048), (1, 8192), (4, 2048), (16, 2048), (32, 128), (32, 1024), (64, 128))]
        print(f"{quant} {v or 'production'}: " + ", ".join(res), flush=True)
