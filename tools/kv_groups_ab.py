"""KV groups (engine.kv_layout) off / on, one synthetic model in MXFP4 on the GPU, side by side: the KV blocks the
memory budget gives, how many 32k-token sequences fit in them, and batch-1 decode ms at each context depth.

    python3 tools/kv_groups_ab.py [synthetic:gemma-3-12b] [128 32000]
"""
import gc
import sys
import time

import torch

from radiance.bench import engine_bench as eb

model = sys.argv[1] if len(sys.argv) > 1 else "synthetic:gemma-3-12b"
contexts = [int(c) for c in sys.argv[2:]] or [128, 32000]
rows = []
for hybrid in (False, True):
    t0 = time.perf_counter()
    engine = eb._engine(model, "mxfp4", 40000, "cuda", None, max_num_batched_tokens=8192, max_num_seqs=16,
                        gpu_memory_utilization=0.85, hybrid_kv_cache=hybrid)
    print(f"[hybrid={hybrid}] built in {time.perf_counter() - t0:.0f} s: {engine.load_summary[-1]}", flush=True)
    bm, layout = engine.block_manager, engine.runner.kv_layout
    per_seq = layout.pages_for(32768, bm.block_size, 8192)
    gen = torch.Generator().manual_seed(0)
    row = {"hybrid": hybrid, "blocks": bm.num_blocks, "layers/block": layout.slots, "blocks per 32k seq": per_seq,
           "32k seqs that fit": bm.num_blocks // per_seq}
    for c in contexts:
        row[f"decode_ms@{c}"] = round(eb._decode_ms(engine, c, 64, gen), 3)
    rows.append(row)
    print(row, flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
print("\n| " + " | ".join(rows[0]) + " |")
for r in rows:
    print("| " + " | ".join(str(v) for v in r.values()) + " |")
