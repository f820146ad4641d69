"""Mixture-of-experts W4A8: stacked expert weights, the grouped GEMM's tilings and launcher
(_triton/moe_gemm.py) and its exact reference. The routing of (token, choice) pairs to expert-sorted slots
and the weighted sum back are moe_routing.py's; the fp8-expanded prefill path is moe_expanded.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from radiance.kernels._triton import moe_gemm as _moe
from radiance.kernels.activation import quantize_rows_from_parts
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.kernels.glu import SILU, GluActivation, glu_reference
from radiance.kernels.moe_routing import ExpertRouting
from radiance.kernels.prepare import WORD_K, PreparedMxfp4, dequantize_prepared, padded_k
from radiance.kernels.reference import quantize_activations_reference, w4a8_matmul_reference
from radiance.kernels.triton_support import triton_serves

ROW_SOURCES = ("token", "pair")


class PreparedExperts(NamedTuple):
    """E experts' PreparedMxfp4 (one shape) stacked along a new leading dim."""

    w_q: torch.Tensor  # int32 [E, N, padded_k(K)/8]
    w_shift: torch.Tensor  # int8 [E, padded_k(K)/128, N, 4]
    w_ref: torch.Tensor  # int32 [E, N]
    w_scale: torch.Tensor  # fp32 [E, N]
    in_features: int  # K
    underflow_blocks: int  # over all experts

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K)"""
        return self.w_q.shape[0], self.w_q.shape[1], self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_q, self.w_shift, self.w_ref, self.w_scale))


def stack_experts(prepared: list[PreparedMxfp4]) -> PreparedExperts:
    """One PreparedExperts from E prepared weights of one shape (copies them)."""
    if not prepared:
        raise ValueError("stack_experts: no experts")
    shapes = {p.shape for p in prepared}
    if len(shapes) != 1:
        raise ValueError(f"stack_experts: experts of different shapes {sorted(shapes)}")
    return PreparedExperts(
        w_q=torch.stack([p.w_q for p in prepared]),
        w_shift=torch.stack([p.w_shift for p in prepared]),
        w_ref=torch.stack([p.w_ref for p in prepared]),
        w_scale=torch.stack([p.w_scale for p in prepared]),
        in_features=prepared[0].in_features,
        underflow_blocks=sum(p.underflow_blocks for p in prepared),
    )


def expert_weight(experts: PreparedExperts, e: int) -> PreparedMxfp4:
    """A view of expert e. Its underflow_blocks is the stack's count: a bound (0 means none for it either)."""
    return PreparedMxfp4(experts.w_q[e], experts.w_shift[e], experts.w_ref[e], experts.w_scale[e],
                         experts.in_features, experts.underflow_blocks)


# Average pairs per expert from which the 64-slot tiles serve; below it the 16-slot ones, which pad each
# expert's group less. Grouped gate_up + down per call on the H200 (graph replays of 8 uniform random routings,
# twenty-eighth session, after the padding slots stopped loading activations), 16-slot / 64-slot us:
# Qwen3-30B-A3B (128 experts, top 8) at 16 / 20 / 24 / 32 pairs per expert 147 / 181 / 200 / 242 against
# 185 / 186 / 186 / 189; gpt-oss-20b (32, top 4) at 16 / 24 / 32: 193 / 266 / 325 against 252 / 251 / 254. In the
# engine Qwen3-30B-A3B's 512-token prefill went 23.2k -> 28.6k tok/s with 32 against 64 here.
PREFILL_PAIRS_PER_EXPERT = 24
# ... and from which the 128-slot tiles serve: each expanded weight tile then feeds twice the MMA work, and with
# ~64 pairs per expert on average many experts overflow one 64-slot tile (a second, mostly padding). Same
# measurement (`tools/moe_gemm_bench.py --block-m 64 128`, thirtieth session), 64-slot / 128-slot us at 48 / 64 / 96
# pairs per expert: Qwen3-30B-A3B 194 / 268 / 360 against 273 / 278 / 294; gpt-oss-20b 258 / 360 / 464 against
# 323 / 333 / 360; Qwen3-235B-A22B's experts (128 x 4096 x 1536, top 8) at 40 / 56 / 64: 695 / 774 / 970 against
# 844 / 874 / 882. (128 pairs per expert until then: the 64-slot tiles ran 22-29% slower at 96.)
LARGE_PAIRS_PER_EXPERT = 64


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """The routing tile for this many pairs: 16 at decode sizes, 64 or 128 when the experts get many pairs."""
    if num_pairs >= LARGE_PAIRS_PER_EXPERT * num_experts:
        return 128
    return 64 if num_pairs >= PREFILL_PAIRS_PER_EXPERT * num_experts else 16


@dataclass(frozen=True)
class MoeGemmConfig:
    """A tiling of the grouped GEMM. block_m is the routing's tile (slots per tile)."""

    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool  # weight rows as the MMA's M and slots as its N (block_m 16..256), or slots as M (% 64)
    num_warps: int = 4
    num_stages: int = 3
    precise_acc: bool = True  # promote fp8 MMA partial sums to fp32 once per K tile (gemm.py)
    # persistent: programs_per_sm programs per SM walk the tiles, pipelining across tile boundaries (moe_gemm.py)
    persistent: bool = False
    programs_per_sm: int = 1

    def __post_init__(self):
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be at least 1, got {self.programs_per_sm}")
        if self.block_k % 128:  # the kernel words come in 128-k groups (prepare.py)
            raise ValueError(f"block_k must be a multiple of 128, got {self.block_k}")
        if self.block_n % 16 or (not self.swap_ab and self.block_m % 64):
            raise ValueError(f"no wgmma tiling for {self}")


# Default tilings by routing block_m (not autotuned at start). Measured on the H200 at Qwen3-30B-A3B's shapes: for 16
# slots, block_k 256 with 4 stages beat block_k 128 (4 or 6 stages), 256 with 3 and 512 with 2 at T = 1, 8, 64 tokens
# (T = 1: gate_up + quantize 13.6 us, down 7.0 us; 9.6 / 5.3 us since the padding slots load no activations,
# twenty-seventh session, where block_k 128 and 512 still lost before that change). For 64 slots the plain tile (slots
# as the MMA's M, 128 weight rows) with two persistent programs per SM beat 26 other tilings (swap-AB 64 / 128 slots,
# plain 64 / 128 / 256 slots by 64 / 128 / 256 rows, block_k 128 / 256, 2-4 stages, 4 / 8 warps, one program per tile
# or 1-3 persistent per SM) on Qwen3-30B-A3B (64-512 pairs per expert: 1.07-1.30x the previous swap-AB 64 / 128-slot
# tiles with uniform routing), gpt-oss-20b (128 / 256: 1.22x / 1.02x) and Qwen3-235B-A22B's shapes (64 / 256: 1.21x /
# 1.07x) (bench/RESULTS.md, twenty-fifth session). Two of its CTAs fit one SM (~66 KB of shared memory each), so one's
# MMAs run under the other's tile change.
MOE_CONFIGS = {
    16: MoeGemmConfig(block_m=16, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=4),
    64: MoeGemmConfig(block_m=64, block_n=128, block_k=128, swap_ab=False, num_warps=4, num_stages=3,
                      persistent=True, programs_per_sm=2),
    # swap-AB 128 x 64 x 256 beat plain 128 x 64 / 128 x 128 tiles (4 or 8 warps), 256 x 64 and swap-AB 128 x
    # 128 x 128 at 256 and 1024 pairs per expert (gpt-oss-20b) and 512 (Qwen3-30B-A3B), by 3-30%
    128: MoeGemmConfig(block_m=128, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=3),
}


def _use_asm(t: torch.Tensor) -> bool:
    return t.is_cuda  # inline asm cannot run under the interpreter (CPU tensors)


def _rows_div(source: str, top_k: int) -> int:
    """Pairs per activation row: top_k for one row per token, 1 for one row per pair."""
    if source not in ROW_SOURCES:
        raise ValueError(f"rows_per_pair_source must be one of {ROW_SOURCES}, not {source!r}")
    return top_k if source == "token" else 1


def _check_operands(x_q, x_scale, experts: PreparedExperts, routing: ExpertRouting, rows_div: int, glu: bool,
                    bias: torch.Tensor | None):
    num_experts, n, k = experts.shape
    if x_q.shape[1] != k or experts.w_q.shape[2] * WORD_K != padded_k(k):
        raise ValueError(f"w4a8_moe_gemm: activations have K={x_q.shape[1]}, the experts K={k}")
    if x_q.shape[0] * rows_div != routing.num_pairs:
        raise ValueError(f"w4a8_moe_gemm: {x_q.shape[0]} activation rows for {routing.num_pairs} pairs "
                         f"({rows_div} pairs per row)")
    if x_q.stride(1) != 1 or x_scale.numel() != x_q.shape[0]:
        raise ValueError("w4a8_moe_gemm: x_q needs contiguous rows and x_scale one scale per row")
    if glu and n % 2:
        raise ValueError(f"w4a8_moe_gemm: a [gate | up] weight has an even row count, not {n}")
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"w4a8_moe_gemm: bias must be [{num_experts}, {n}] (experts, rows), not {list(bias.shape)}")
    if not triton_serves(x_q):
        raise ValueError("w4a8_moe_gemm: no Triton on this device (CUDA or the interpreter); on the CPU the "
                         "MoE layer runs its experts one by one")


def w4a8_moe_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, experts: PreparedExperts, routing: ExpertRouting, *,
                  rows_per_pair_source: str, glu: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                  config: MoeGemmConfig | None = None, use_asm: bool | None = None, out: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, activation: GluActivation = SILU):
    """Every pair's row of x times its expert's weight: x_q e4m3 [R, K], x_scale fp32 [R, 1], R = T with
    rows_per_pair_source "token" (row of pair p: p // top_k), R = T * top_k with "pair" (row p).

    glu=False: out [T * top_k, N] in out_dtype, row p = (x_row(p) * scale) @ W_expert(p)^T + bias[expert(p)].
    glu=True (a merged [gate | up] expert weight and bias): (y_q e4m3 [T * top_k, N/2], y_scale fp32
    [T * top_k, 1]), quantize_activations(glu_reference(that, activation)), where each expert's rows with silu
    and no bias are the bytes of w4a8_glu. bias (optional, [E, N], any float dtype) is added in fp32 to the
    scaled sum before its one rounding to out_dtype; `activation` serves only glu.
    `out` (optional) is the [T * top_k, N] output, or with glu the [T * top_k, N/2] activation rows before
    quantization. Launched as a programmatic dependent where the GPU has it (sm_90), as the dense GEMM is."""
    y, amax, _ = _launch(x_q, x_scale, experts, routing, rows_per_pair_source, glu, out_dtype, config, use_asm, out,
                         bias, activation)
    return quantize_rows_from_parts(y, amax, launch="moe_parts_quantize") if glu else y


def _launch(x_q, x_scale, experts: PreparedExperts, routing: ExpertRouting, source: str, glu: bool, out_dtype,
            config: MoeGemmConfig | None, use_asm: bool | None, out: torch.Tensor | None,
            bias: torch.Tensor | None = None, activation: GluActivation = SILU):
    """w4a8_moe_gemm's GEMM: (output, amax parts [pairs, column tiles] with glu else None, compiled kernel
    or None when nothing ran)."""
    rows_div = _rows_div(source, routing.top_k)
    _check_operands(x_q, x_scale, experts, routing, rows_div, glu, bias)
    cfg = config or MOE_CONFIGS[routing.block_m]
    if cfg.block_m != routing.block_m:
        raise ValueError(f"w4a8_moe_gemm: tiling block_m {cfg.block_m} on a routing of block_m {routing.block_m}")
    _, n, k = experts.shape
    pairs = routing.num_pairs
    out_n = n // 2 if glu else n
    tiles_n = -(-out_n // (cfg.block_n // 2)) if glu else -(-n // cfg.block_n)
    if out is None:
        out = torch.empty((pairs, out_n), dtype=out_dtype, device=x_q.device)
    elif out.shape != (pairs, out_n) or out.stride(1) != 1:
        raise ValueError(f"w4a8_moe_gemm: out must be [{pairs}, {out_n}] with contiguous rows")
    amax = torch.empty((pairs, tiles_n), dtype=torch.int32, device=x_q.device) if glu else None
    work = routing.tile_expert.numel() * tiles_n  # an upper bound: the used tiles are known on the device only
    programs = min(work, sm_count(x_q.device) * cfg.programs_per_sm) if cfg.persistent else work
    if pairs == 0 or work == 0:
        return out, amax, None
    pdl = supports_pdl(x_q.device)
    compiled = _moe.w4a8_moe_gemm_kernel[(programs,)](
        x_q, x_scale.reshape(-1), experts.w_q, experts.w_shift.view(torch.int32), experts.w_scale,
        bias.contiguous() if bias is not None else experts.w_scale, out, amax if glu else out,
        routing.sorted_pairs, routing.tile_expert, routing.group_ends, experts.shape[0], pairs, rows_div, n, k,
        x_q.stride(0), out.stride(0), programs,
        SWAP_AB=cfg.swap_ab, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, EVEN_K=(k % cfg.block_k == 0),
        USE_ASM=_use_asm(x_q) if use_asm is None else use_asm, PRECISE_ACC=cfg.precise_acc,
        HAS_BIAS=bias is not None, GLU=glu, **(activation.kernel_constexprs() if glu else {}),
        PERSISTENT=cfg.persistent, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, amax, compiled


def moe_gemm_ptx(x_q, x_scale, experts: PreparedExperts, routing: ExpertRouting, rows_per_pair_source: str,
                 config: MoeGemmConfig | None = None) -> str:
    """PTX of the grouped GEMM kernel that serves this call (CUDA only; empty when nothing ran)."""
    compiled = _launch(x_q, x_scale, experts, routing, rows_per_pair_source, False, torch.bfloat16, config,
                       None, None)[2]
    return compiled.asm.get("ptx", "") if compiled is not None else ""


@torch.no_grad()
def w4a8_moe_reference(x_q: torch.Tensor, x_scale: torch.Tensor, experts: PreparedExperts, topk_ids: torch.Tensor,
                       *, rows_per_pair_source: str, glu: bool = False,
                       out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                       activation: GluActivation = SILU):
    """What w4a8_moe_gemm computes, exactly (fp32 math, fp64 on CUDA; reference.w4a8_matmul_reference per
    expert on its dequantized weight, its bias row added before the rounding to out_dtype), with glu
    glu_reference(gate_up, activation) rounded as torch does in out_dtype, then quantize_activations_reference.
    Syncs with the host: the tests' oracle (the CPU MoE layer runs its experts one by one instead)."""
    tokens, top_k = topk_ids.shape
    rows_div = _rows_div(rows_per_pair_source, top_k)
    expert_of_pair = topk_ids.reshape(-1).to(torch.int64)
    n = experts.shape[1]
    out = torch.empty((tokens * top_k, n), dtype=out_dtype, device=x_q.device)
    for e in torch.unique(expert_of_pair).tolist():
        pairs = torch.nonzero(expert_of_pair == e).flatten()
        rows = pairs // rows_div
        w = dequantize_prepared(expert_weight(experts, e))
        out[pairs] = w4a8_matmul_reference(x_q[rows], x_scale[rows], w, bias[e] if bias is not None else None,
                                           out_dtype)
    return quantize_activations_reference(glu_reference(out, activation)) if glu else out
