"""Launcher of the W4A8 GEMM on prepared MXFP4 weights (see _triton/gemm.py for the kernel)."""

from __future__ import annotations

import functools

import torch

from radiance.kernels._triton import convert as _convert
from radiance.kernels._triton import gemm as _gemm
from radiance.kernels.prepare import PreparedMxfp4
from radiance.kernels.tuning import GemmConfig, select_config

REDUCE_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    # the interpreter has no SMs; 4 keeps split-K exercised in CPU tests
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 4


def choose_split_k(m: int, n: int, k: int, cfg: GemmConfig, num_sms: int) -> tuple[int, int]:
    """(splits, k_tiles_per_split): enough CTAs for ~2 waves, no empty split."""
    k_tiles = -(-k // cfg.block_k)
    if cfg.split_k == 1:
        return 1, k_tiles
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    waves = 2 if m <= 64 else 1  # big-M splits pay for their fp32 partials: one wave is enough
    want = cfg.split_k if cfg.split_k > 1 else -(-waves * num_sms // tiles)
    splits = max(1, min(want, k_tiles, 64))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


def _use_asm(t: torch.Tensor) -> bool:
    return t.is_cuda  # inline asm cannot run under the interpreter (CPU tensors)


def w4a8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: PreparedMxfp4, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, *, decode_band: int = 64, config: GemmConfig | None = None,
              use_asm: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = (x_q * x_scale) @ W^T (+ bias), W the prepared MXFP4 weight; fp32 accumulation."""
    return _launch(x_q, x_scale, weight, bias, out_dtype, decode_band, config, use_asm, out)[0]


def _launch(x_q, x_scale, weight, bias, out_dtype, decode_band, config, use_asm, out):
    """w4a8_gemm's body; also returns the compiled GEMM kernel (its PTX is checked for wgmma)."""
    m, k = x_q.shape
    n, wk = weight.shape
    if wk != k:
        raise ValueError(f"w4a8_gemm: activations have K={k} but the weight has K={wk}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out, None
    cfg = config or select_config(m, n, k, decode_band, x_q.device)
    splits, per_split = choose_split_k(m, n, k, cfg, sm_count(x_q.device))
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device) if splits > 1 else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight.w_scale
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), splits)
    compiled = _gemm.w4a8_gemm_kernel[grid](
        x_q, x_scale, weight.w_q, weight.w_shift, weight.w_scale, bias_arg, out, part,
        m, n, k, x_q.stride(0), out.stride(0), per_split,
        HAS_BIAS=has_bias, SWAP_AB=cfg.swap_ab, SPLIT_K=splits, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=(k % cfg.block_k == 0), USE_ASM=_use_asm(x_q) if use_asm is None else use_asm,
        PRECISE_ACC=cfg.precise_acc,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _gemm.splitk_reduce_kernel[(-(-m * n // REDUCE_BLOCK),)](
            part, bias_arg, out, m, n, out.stride(0), SPLITS=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK, num_warps=4)
    return out, compiled


def gemm_ptx(x_q, x_scale, weight: PreparedMxfp4, decode_band: int = 64, config: GemmConfig | None = None) -> str:
    """PTX of the GEMM kernel that serves this call (CUDA only)."""
    compiled = _launch(x_q, x_scale, weight, None, torch.bfloat16, decode_band, config, None, None)[1]
    return compiled.asm.get("ptx", "") if compiled is not None else ""


def expand_weight_fp8(weight: PreparedMxfp4, use_asm: bool | None = None) -> torch.Tensor:
    """The e4m3 weight [N, K] the GEMM multiplies with (before the per-row 2^ref): tests and baselines."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.w_q.device)
    bn, bk = 32, 128
    grid = (-(-n // bn), -(-k // bk))
    _convert.expand_weight_kernel[grid](weight.w_q, weight.w_shift, out, n, k, BN=bn, BK=bk,
                                        USE_ASM=_use_asm(weight.w_q) if use_asm is None else use_asm)
    return out
