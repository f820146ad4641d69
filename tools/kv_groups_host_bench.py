"""Host time of decode steps with KV groups, no GPU needed: 64 sequences at 32k tokens in a layout of one full group
and GROUPS - 1 window-1024 groups (7: Gemma 3 27B's), the block manager's can_allocate + allocate (with its
releases) and StepInputs.prepare, ms per step.

    python3 tools/kv_groups_host_bench.py [GROUPS]
"""
import sys
import time

import torch

from radiance.engine.block_manager import BlockManager
from radiance.engine.kv_layout import KvLayout, LocalSpan
from radiance.engine.sampling_params import SamplingParams
from radiance.engine.sequence import Sequence
from radiance.engine.scheduler import ScheduledSequence
from radiance.engine.step_inputs import StepInputs

groups = int(sys.argv[1]) if len(sys.argv) > 1 else 7
B, ctx, bs = 64, 32768, 16
spans = (None,) + (LocalSpan(1024),) * (groups - 1)
layout = KvLayout(10, tuple((g,) for g in range(groups)), spans)
bm = BlockManager(B * (ctx // bs + 200) * groups, bs, False, layout=layout)
seqs = [Sequence(str(i), [1] * (ctx + 200), SamplingParams(max_tokens=4), 0) for i in range(B)]
for seq in seqs:
    while seq.num_computed_tokens < ctx:
        bm.allocate(seq, 8192)
        seq.num_computed_tokens += 8192
si = StepInputs(bs, groups, torch.device("cuda"))
t_bm = t_prep = 0.0
steps = 64
for step in range(steps + 4):
    t0 = time.perf_counter()
    for seq in seqs:
        assert bm.can_allocate(seq, 1)  # as the scheduler asks of each running sequence
        bm.allocate(seq, 1)
    t1 = time.perf_counter()
    si.prepare([ScheduledSequence(seq, 1) for seq in seqs])
    t2 = time.perf_counter()
    for seq in seqs:
        seq.num_computed_tokens += 1
    if step >= 4:
        t_bm += t1 - t0
        t_prep += t2 - t1
print(f"{groups} groups: can_allocate + allocate {t_bm / steps * 1e3:.3f} ms, prepare {t_prep / steps * 1e3:.3f} ms per step")
