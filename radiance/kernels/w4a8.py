"""Launcher of the W4A8 GEMM on prepared MXFP4 weights (see _triton/gemm.py for the kernel)."""

from __future__ import annotations

import torch

from radiance.kernels._triton import convert as _convert
from radiance.kernels._triton import gemm as _gemm
from radiance.kernels.activation import quantize_rows_from_parts
from radiance.kernels.buffers import device_buffer
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.kernels.glu import SILU, GluActivation, glu_mul
from radiance.kernels.norm import PartialSums
from radiance.kernels.occupancy import ctas_per_sm_at_most
from radiance.kernels.prepare import WORD_K, PreparedMxfp4, padded_k
from radiance.kernels.tuning import GemmConfig, expand_min_m, glu_epilogue_serves, select_config


def choose_split_k(m: int, n: int, k: int, cfg: GemmConfig, num_sms: int) -> tuple[int, int]:
    """(splits, k_tiles_per_split): enough CTAs to keep HBM busy, no empty split."""
    k_tiles = -(-k // cfg.block_k)
    if cfg.split_k == 1:
        return 1, k_tiles
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    # decode streams weights: about two CTAs per SM measured best (four: more partial traffic and a
    # longer tail); bigger M pays more for its fp32 partials, so one wave
    waves = 2 if m <= 64 else 1
    want = cfg.split_k if cfg.split_k > 1 else -(-waves * num_sms // tiles)
    splits = max(1, min(want, k_tiles, 64))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per output tile, for the split-K launches: each launch leaves
    its counters at zero again."""
    return device_buffer("tile-counters", device, max(tiles, 16384), torch.int32, zeroed=True)


# GLU kinds the dense W4A8 GEMM's epilogue applies (no clamp parameters; gpt-oss's runs in the MoE GEMM)
DENSE_GLU_KINDS = ("silu", "gelu_tanh")

# K tiles per weight row that a GEMM launched as a programmatic dependent (PDL, sm_90+) prefetches into
# L2 while the kernel before it (the norm or SiLU that quantizes its activations) still runs (0: none).
# In the 8B's batch-1 decode step on the H200: 0 / 1 / 2 / 4 / 8 tiles 2.317 / 2.240 / 2.279 / 2.389 /
# 2.508 ms (deeper prefetches hold the CTA before its wait; bench/RESULTS.md, thirteenth session)
PDL_PREFETCH_TILES = 1
# Per-shape depths {(n, k): tiles} that replace PDL_PREFETCH_TILES for one GEMM shape (tools/pdl_prefetch_sweep.py
# --shape): since the dense down GEMM launches while gate_up still runs (triton_support.PDL_EARLY_RELEASE), it has
# that whole GEMM to prefetch in. None measured yet.
PDL_PREFETCH_TILES_BY_SHAPE: dict[tuple[int, int], int] = {}


def pdl_prefetch_tiles(n: int, k: int) -> int:
    """K tiles of weights an [n, k] GEMM launched as a programmatic dependent prefetches before its wait."""
    return PDL_PREFETCH_TILES_BY_SHAPE.get((n, k), PDL_PREFETCH_TILES)


# decode-band GEMMs captured into a CUDA graph ask for the shared memory that fits at most ceil(CTAs / SMs) of
# their CTAs per SM (occupancy.ctas_per_sm_at_most): 8B decode -3.6% per step at batch 8, -3.7% at 32 on the H200,
# batch 1 unchanged (bench/RESULTS.md, thirty-second session). Only in graphs (an eager launch would pay a second
# kernel lookup on the host, and eager decode steps are host-bound anyway) and only for programmatic dependents.
OCCUPANCY_CAP_IN_GRAPHS = True


def _use_asm(t: torch.Tensor) -> bool:
    return t.is_cuda  # inline asm cannot run under the interpreter (CPU tensors)


def w4a8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: PreparedMxfp4, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, *, decode_band: int = 64, config: GemmConfig | None = None,
              use_asm: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = (x_q * x_scale) @ W^T (+ bias), W the prepared MXFP4 weight; fp32 accumulation.

    From the tuning table's `expand_min_m` tokens on (and no forced `config`), the weight is expanded
    to e4m3 in a scratch buffer and multiplied by cuBLAS's fp8 GEMM: at that M the expansion costs a
    few percent of the GEMM, and cuBLAS keeps full fp32 accumulation at fp8 speed, which the fused
    kernel's per-tile promotion does not (bench/RESULTS.md)."""
    m, n = x_q.shape[0], weight.shape[0]
    if config is None and _expand_serves(x_q, m, n, weight.shape[1], out_dtype, out):
        return _expand_then_fp8_mm(x_q, x_scale, weight, bias, out_dtype)
    return _launch(x_q, x_scale, weight, bias, out_dtype, decode_band, config, use_asm, out)[0]


def w4a8_gemm_partials(x_q: torch.Tensor, x_scale: torch.Tensor, weight: PreparedMxfp4,
                       out_dtype: torch.dtype = torch.bfloat16, *, decode_band: int = 64,
                       config: GemmConfig | None = None, use_asm: bool | None = None) -> PartialSums:
    """w4a8_gemm without bias, its output left as fp32 split-K partials for the kernel that reads it next
    to sum (PartialSums; add_rmsnorm): the GEMM's CTAs end after storing their partial, with no fence,
    atomic and reload of a last-arrival sum on the way (deferring_pays says where that wins). A launch
    with one split writes its fp32 sums as the one partial."""
    m, n = x_q.shape[0], weight.shape[0]
    parts = _launch(x_q, x_scale, weight, None, out_dtype, decode_band, config, use_asm, None, defer_sum=True)[0]
    return PartialSums(parts, n, out_dtype, (m,))


# The residual-add norm that sums deferred partials runs one program per token, so at M = 1 one SM reads
# every split's fp32 row. In the decode step on the H200 (bench/RESULTS.md, fifteenth session): the 8B's
# o_proj and down_proj (4 partials of 16 KiB per row) gain 58 us per step at batch 1, the 32B's (4 and 6
# of 20 KiB) lose 25-110 us; at batch 8 both gain (8B 77 us, 32B 110 us). Since the norm loads every partial at
# once and the occupancy cap, the 32B's down (6 partials, 120 KiB) gains 30 us at batch 1 too (thirty-fourth
# session, tools/module_setting_ab.py).
DEFER_MAX_ROW_BYTES_AT_M1 = 128 * 1024


def deferring_pays(m: int, n: int, k: int, decode_band: int, device: torch.device) -> bool:
    """Whether w4a8_gemm_partials beats w4a8_gemm for an output a residual-add norm reads next."""
    if m == 0 or m > decode_band:
        return False
    splits, _ = choose_split_k(m, n, k, select_config(m, n, k, decode_band, device), sm_count(device))
    return m > 1 or splits * n * 4 <= DEFER_MAX_ROW_BYTES_AT_M1


def _expand_serves(x_q: torch.Tensor, m: int, n: int, k: int, out_dtype, out) -> bool:
    min_m = expand_min_m(x_q.device)
    return (min_m is not None and m >= min_m and out is None and n % 16 == 0 and k % 16 == 0
            and x_q.stride(1) == 1 and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


def expand_scratch(device: torch.device, numel: int) -> torch.Tensor:
    """The e4m3 buffer for the expanded weights of the large-M paths (dense and grouped): a fresh 100+ MB
    allocation per call can push the caching allocator (next to a KV cache that fills the GPU) into
    free-and-retry."""
    return device_buffer("expand-scratch", device, numel, torch.float8_e4m3fn, zeroed=False)


def _expand_then_fp8_mm(x_q, x_scale, weight: PreparedMxfp4, bias, out_dtype) -> torch.Tensor:
    n, k = weight.shape
    # [N, K] e4m3 with the block shifts folded in; the row scale is w_scale
    w8 = expand_weight_fp8(weight, out=expand_scratch(x_q.device, n * k)[: n * k].view(n, k))
    # cuBLASLt takes no bias with an fp32 output: add it afterwards there
    fused_bias = bias is not None and out_dtype != torch.float32
    out = torch._scaled_mm(x_q, w8.t(), scale_a=x_scale.float(), scale_b=weight.w_scale[None, :],
                           bias=bias.to(out_dtype) if fused_bias else None, out_dtype=out_dtype)
    if bias is not None and not fused_bias:
        out += bias.to(out_dtype)
    return out


def w4a8_glu(x_q: torch.Tensor, x_scale: torch.Tensor, weight: PreparedMxfp4, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, *, decode_band: int = 64, config: GemmConfig | None = None,
             use_asm: bool | None = None, activation: GluActivation = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(glu_mul(w4a8_gemm(...), activation)) for a merged [gate | up] weight (N = 2I rows):
    (x_q e4m3 [M, I], x_scale fp32 [M, 1]), the same bytes. The GEMM's epilogue computes act(gate) * up
    (SiLU, or Gemma's GeGLU) and each tile's row amax, so one quantize launch follows and no GLU launch (nor
    the [M, 2I] gate_up tensor); on the expand path (M >= expand_min_m), and for the tuning table's
    `unfused_glu_shapes`, it is the GEMM, then glu_mul."""
    m, n = x_q.shape[0], weight.shape[0]
    if n % 2:
        raise ValueError(f"w4a8_glu: a [gate | up] weight has an even row count, not {n}")
    if activation.kind not in DENSE_GLU_KINDS:
        raise ValueError(f"w4a8_glu: the dense GLU epilogue takes {DENSE_GLU_KINDS}, not {activation.kind!r}")
    k = weight.shape[1]
    if config is None and (not glu_epilogue_serves(n, k, x_q.device) or _expand_serves(x_q, m, n, k, out_dtype, None)):
        # w4a8_gemm takes the expand path itself where it serves
        act = glu_mul(w4a8_gemm(x_q, x_scale, weight, bias, out_dtype, decode_band=decode_band, use_asm=use_asm),
                      activation, quantize=True)
        return act.x_q, act.x_scale
    y, _, amax = _launch(x_q, x_scale, weight, bias, out_dtype, decode_band, config, use_asm, None, glu=True,
                         act=activation.kernel_code)
    # the early release was measured before decode-band down GEMMs (grids that fit the SMs at once) only
    return quantize_rows_from_parts(y, amax, launch="parts_quantize" if m <= decode_band else "prefill_parts_quantize")


def _launch(x_q, x_scale, weight, bias, out_dtype, decode_band, config, use_asm, out, glu: bool = False,
            defer_sum: bool = False, act: int = 0):
    """w4a8_gemm's body (with `glu`, w4a8_glu's GEMM; with `defer_sum`, w4a8_gemm_partials's, whose output
    is the partials [splits, M, width] fp32): (output, the compiled GEMM kernel, with `glu` the row amax
    parts [M, column tiles] int32 else None). The PTX of the kernel is checked for wgmma."""
    m, k = x_q.shape
    n, wk = weight.shape
    if wk != k or weight.w_q.shape[1] * WORD_K != padded_k(k):
        raise ValueError(f"w4a8_gemm: activations have K={k} but the weight has K={wk} "
                         f"({weight.w_q.shape[1]} kernel words per row)")
    if defer_sum and (glu or bias is not None or out is not None):
        raise ValueError("w4a8_gemm_partials: no GLU epilogue, bias or output buffer with deferred sums")
    out_n = n // 2 if glu else n
    cfg = config or select_config(m, n, k, decode_band, x_q.device)
    splits, per_split = choose_split_k(m, n, k, cfg, sm_count(x_q.device)) if m else (1, 0)
    tiles_n = -(-out_n // (cfg.block_n // 2)) if glu else -(-n // cfg.block_n)
    part = (torch.empty((splits, m, tiles_n * cfg.block_n), dtype=torch.float32, device=x_q.device)
            if splits > 1 else None)  # split-K partials
    if defer_sum:  # the partials are the output; one split writes its fp32 sums as the one partial
        out = part[0] if part is not None else torch.empty((m, n), dtype=torch.float32, device=x_q.device)
        result = part if part is not None else out[None]
    else:
        out = out if out is not None else torch.empty((m, out_n), dtype=out_dtype, device=x_q.device)
        result = out
    part = part if part is not None else out  # the kernel's part_ptr, unused without a split
    amax = torch.empty((m, tiles_n), dtype=torch.int32, device=x_q.device) if glu else None
    if m == 0:
        return result, None, amax
    tiles = -(-m // cfg.block_m) * tiles_n
    locks = _tile_counters(x_q.device, tiles) if splits > 1 else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight.w_scale
    grid = (tiles, splits)
    dependent = supports_pdl(x_q.device)
    def launch(warmup: bool):  # warmup: the compiled kernel these arguments select, not launched
        return _gemm.w4a8_gemm_kernel.run(
            x_q, x_scale, weight.w_q, weight.w_shift.view(torch.int32), weight.w_scale, bias_arg, out, part, locks,
            amax if glu else out, m, n, k, x_q.stride(0), out.stride(0), per_split, splits, grid=grid, warmup=warmup,
            HAS_BIAS=has_bias, SWAP_AB=cfg.swap_ab, SPLIT=splits > 1, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            GROUP_M=cfg.group_m, EVEN_K=(k % cfg.block_k == 0), USE_ASM=_use_asm(x_q) if use_asm is None else use_asm,
            PRECISE_ACC=cfg.precise_acc, DEPENDENT=dependent, PDL_PREFETCH=pdl_prefetch_tiles(n, k) if dependent else 0,
            GLU=glu, DEFER_SUM=defer_sum, ACT=act, launch_pdl=dependent,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    # the placement it evens out is a programmatic dependent's (sm_90); elsewhere unmeasured
    if OCCUPANCY_CAP_IN_GRAPHS and dependent and m <= decode_band and torch.cuda.is_current_stream_capturing():
        with ctas_per_sm_at_most(launch(warmup=True), -(-(tiles * splits) // sm_count(x_q.device)), x_q.device):
            compiled = launch(warmup=False)
    else:
        compiled = launch(warmup=False)
    return result, compiled, amax


def gemm_ptx(x_q, x_scale, weight: PreparedMxfp4, decode_band: int = 64, config: GemmConfig | None = None) -> str:
    """PTX of the GEMM kernel that serves this call (CUDA only)."""
    compiled = _launch(x_q, x_scale, weight, None, torch.bfloat16, decode_band, config, None, None)[1]
    return compiled.asm.get("ptx", "") if compiled is not None else ""


def expand_weight_fp8(weight: PreparedMxfp4, use_asm: bool | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The e4m3 weight [N, K] the GEMM multiplies with (before the per-row 2^ref): the large-M path,
    tests and baselines."""
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.w_q.device)
    launch_expand(weight.w_q, weight.w_shift, out, n, k, 1, use_asm)
    return out


def launch_expand(w_q: torch.Tensor, w_shift: torch.Tensor, out: torch.Tensor, n: int, k: int, experts: int,
                  use_asm: bool | None) -> None:
    """Expand `experts` stacked weights of N x K (w_q, w_shift as prepare.py lays them out, stacked along a
    leading dim when experts > 1) into the contiguous e4m3 `out` [experts, N, K]."""
    bn, bk = 64, 256
    grid = (-(-n // bn), -(-k // bk), experts)
    _convert.expand_weight_kernel[grid](w_q, w_shift, out, n, k, BN=bn, BK=bk, num_warps=4,
                                        USE_ASM=_use_asm(w_q) if use_asm is None else use_asm)
