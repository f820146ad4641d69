"""What the Triton launchers of `kernels/` share: whether the Triton kernels serve a tensor's device, and the
shape of their one-program-per-row launches (activation.py: the fp8 quantize, norm.py: the residual-add
RMSNorm, glu.py: the GLU multiply), the row barrier's buffers, and which launches release their PDL
dependents early.
"""

from __future__ import annotations

import torch

from radiance import env
from radiance.kernels.buffers import device_buffer

MAX_ROW = 65536  # one row lives in registers
CHUNK = 1024  # elements per program when a row is spread over several (silu_mul at decode)
MANY_ROWS = 1024  # rows from which quantize_activations launches small programs (prefill sizes, measured)


def triton_serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on t's device (CUDA, or the CPU interpreter)."""
    return t.is_cuda or env.triton_interpret()


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): block sizes and padded widths of the launchers."""
    return 1 << (max(1, n) - 1).bit_length()


def row_launch(k: int, m: int = 1) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-program-per-row kernel over m rows of k elements."""
    block = max(next_pow2(k), 16)
    if m >= MANY_ROWS:
        # many programs per SM: small ones overlap one another's load, reduce and store phases
        # (H200, 4096 x 4096: 19.4 -> 14.8 us; bench/RESULTS.md, eighth session)
        return block, 4 if block <= 8192 else 8
    # 16 warps from 4096 elements on: at decode a row is one program, and fewer warps leave the SM's
    # schedulers idle on the reduction and division latencies
    return block, max(1, min(16, block // 256))


def row_barrier_buffers(device: torch.device, rows: int, parties: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax slots int32 [rows * parties], arrival counts int64 [rows]) for kernels whose programs
    agree on a row's scale (act_quant.shared_row_scale). The counts only grow, by `parties` per
    launch, so each party count keeps its own zero-initialised array."""
    rows = max(rows, 1024)
    return (device_buffer(f"row-amax-slots-{parties}", device, rows * parties, torch.int32, zeroed=True),
            device_buffer(f"row-arrivals-{parties}", device, rows, torch.int64, zeroed=True))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# Launches that let the GEMM after them launch before they wait for the GEMM before them, so that it becomes resident
# and prefetches its weights while that GEMM runs (pdl_handoff's EARLY): the residual-add norms before qkv
# ("attn_norm") and before the MLP ("mlp_norm"; "norm": any other), the quantize between gate_up and down
# ("parts_quantize" in the decode band, "prefill_parts_quantize" above it; "moe_parts_quantize" before a grouped
# expert GEMM). In the decode step on the H200 (bench/RESULTS.md, thirty-fourth session, tools/early_release_ab.py):
# "parts_quantize" saves 20-30 us per 8B step at batch 1 and is neutral at batch 8 / 64 and on the 32B; both layer
# norms together are neutral on the 8B and cost the 32B 20-40 us (each alone unmeasured); the grouped quantize costs
# gpt-oss-20b 200 us at batch 1 (the early expert GEMM's CTAs hold SM room that gate_up's later CTAs wait for),
# which a prefill-sized down GEMM (more CTAs than fit at once) risks too (unmeasured).
EARLY_RELEASE_LAUNCHES = ("attn_norm", "mlp_norm", "norm", "parts_quantize", "prefill_parts_quantize",
                          "moe_parts_quantize")
PDL_EARLY_RELEASE: frozenset[str] = frozenset({"parts_quantize"})


def releases_early(launch: str, pdl: bool) -> bool:
    """Whether `launch` (one of EARLY_RELEASE_LAUNCHES) lets its dependents launch before its wait."""
    if launch not in EARLY_RELEASE_LAUNCHES:
        raise ValueError(f"unknown launch {launch!r} for PDL_EARLY_RELEASE; known: {', '.join(EARLY_RELEASE_LAUNCHES)}")
    return pdl and launch in PDL_EARLY_RELEASE
