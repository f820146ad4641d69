"""GPU timing for kernel benchmarks: CUDA-graph replays over rotated buffers (METHOD.md rules)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

L2_BYTES = 60 << 20  # H200 L2; inputs are rotated so that each launch reads cold weights
ROTATE_BYTES = 4 * L2_BYTES


def copies_to_rotate(nbytes: int, limit: int = 32) -> int:
    """How many copies of an operand of nbytes keep the working set well past the L2."""
    return max(2, min(limit, -(-ROTATE_BYTES // max(1, nbytes))))


def time_us(calls: Sequence[Callable[[], object]], target_ms: float = 60.0, graph: bool = True) -> float:
    """Median-free mean time of one call, in microseconds, from CUDA-graph replays of all `calls`
    back to back (launch gaps out of the number); falls back to eager launches if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compile, autotune-free first launch, allocator pools
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    runner: Callable[[], None]
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for fn in calls:
                    fn()
            runner = g.replay
        except Exception:  # noqa: BLE001 - some baselines refuse capture; time them eagerly
            torch.cuda.synchronize()
            runner = lambda: [fn() for fn in calls]  # noqa: E731
    else:
        runner = lambda: [fn() for fn in calls]  # noqa: E731
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runner()
    start.record()
    runner()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = int(max(2, min(200, target_ms / once)))
    times = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            runner()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[1] * 1000.0 / len(calls)
