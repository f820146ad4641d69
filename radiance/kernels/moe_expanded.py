"""Mixture-of-experts prefill on fp8 weights: experts whose gate_up shape the tuning table lists run, from
enough pairs per expert, expanded to e4m3 (every expert in one launch) on torch's fp8 grouped GEMM."""

from __future__ import annotations

import torch

from radiance.kernels.device_info import capability
from radiance.kernels.moe import PreparedExperts
from radiance.kernels.tuning import moe_expand_listed
from radiance.kernels.w4a8 import expand_scratch, launch_expand

# Average pairs per expert from which experts of a shape the tuning table lists (`moe_expand_shapes`) run
# as fp8 weights on torch's grouped GEMM: every expert expanded to e4m3 in one launch, then
# torch._scaled_grouped_mm (CUTLASS, sm_90). gpt-oss-20b's MoE block on the H200 (CUDA-graph replays), us at
# 256 / 512 / 1024 pairs per expert: expanded 1243 / 1785 / 2791, grouped W4A8 kernel 1430 / 2406 / 3801,
# bf16 experts 1120 / 1874 / 3195. In the engine a 2048-token prefill (256 per expert) was no faster expanded
# (best 47.9 against 48.7 ms: the expansion of every expert is then ~15% of it); 4096 / 8192 tokens 64.8 / 119.6
# against 78.1 / 147.1 ms. Qwen3-30B-A3B's smaller experts stay on the kernel (twenty-fourth session).
EXPAND_PAIRS_PER_EXPERT = 512


def expand_serves(x: torch.Tensor, num_pairs: int, experts: PreparedExperts) -> bool:
    """Whether w4a8_moe_mm_expanded serves these experts for this many pairs of activations like x: a Hopper
    GPU (the fp8 grouped GEMM torch ships for sm_90), a listed shape and enough pairs per expert."""
    num_experts, n, k = experts.shape
    return (num_pairs >= EXPAND_PAIRS_PER_EXPERT * num_experts  # first: decode steps stop here
            and x.is_cuda and hasattr(torch, "_scaled_grouped_mm")
            and capability(x.device) == (9, 0) and moe_expand_listed(n, k, x.device))


def expand_experts_fp8(experts: PreparedExperts, out: torch.Tensor | None = None,
                       use_asm: bool | None = None) -> torch.Tensor:
    """Every expert's e4m3 weight [E, N, K] with its block shifts folded in (its row scale is w_scale), as the
    GEMM kernels see it: one launch."""
    num_experts, n, k = experts.shape
    if out is None:
        out = torch.empty((num_experts, n, k), dtype=torch.float8_e4m3fn, device=experts.w_q.device)
    launch_expand(experts.w_q, experts.w_shift, out, n, k, num_experts, use_asm)
    return out


def w4a8_moe_mm_expanded(x_q: torch.Tensor, x_scale: torch.Tensor, experts: PreparedExperts,
                         group_ends: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                         use_asm: bool | None = None) -> torch.Tensor:
    """[R, N] = rows of x_q e4m3 [R, K] (scales x_scale fp32 [R, 1]) sorted by expert, times their expert's
    weight. Rows group_ends[e-1] .. group_ends[e] - 1 are expert e's (torch._grouped_mm's offs; a routing of
    block_m 1). The experts are expanded to e4m3 in the shared scratch and multiplied by
    torch._scaled_grouped_mm (fp32 accumulation, rowwise scales x_scale and the weights' 2^ref), its bf16
    result cast to out_dtype. No host sync. On the CPU (tests) the grouped GEMM is its fp32 torch equivalent.
    Expert biases are the consumers' (glu_mul, combine_experts), which add them as they read."""
    num_experts, n, k = experts.shape
    rows = x_q.shape[0]
    if x_q.shape[1] != k or group_ends.shape != (num_experts,):
        raise ValueError(f"w4a8_moe_mm_expanded: activations [{rows}, {x_q.shape[1]}] and {group_ends.numel()} "
                         f"group ends for {num_experts} experts of K={k}")
    if k % 16 or n % 16:
        raise ValueError(f"w4a8_moe_mm_expanded: fp8 GEMMs need N and K multiples of 16, not {n} x {k}")
    numel = num_experts * n * k
    scratch = expand_scratch(x_q.device, numel) if x_q.is_cuda else None
    w8 = expand_experts_fp8(experts, scratch[:numel].view(num_experts, n, k) if scratch is not None else None,
                            use_asm)
    scale_a = x_scale.reshape(-1).float()
    if x_q.is_cuda:
        out = torch._scaled_grouped_mm(x_q, w8.transpose(1, 2), scale_a, experts.w_scale, offs=group_ends,
                                       out_dtype=torch.bfloat16)
    else:
        b = w8.float() * experts.w_scale[:, :, None]
        out = torch._grouped_mm(x_q.float() * scale_a[:, None], b.transpose(1, 2), offs=group_ends)
    return out.to(out_dtype)
