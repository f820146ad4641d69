"""NVFP4 in the compressed-tensors convention (`nvfp4-pack-quantized`).

e2m1 codes with one float8_e4m3fn scale per 16 consecutive k, and one fp32 global scale per
partition of a merged linear, stored as a DIVISOR (448 * 6 / amax):
    W[n, k] = e2m1[n, k] * fp32(scale[n, k // 16]) / global_scale[partition(n)]
"""

from __future__ import annotations

import torch

from radiance.formats._checks import check_finite, check_k_multiple, check_matrix, check_partitions
from radiance.formats.e2m1 import E2M1_MAX, e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1
from radiance.formats.mxfp4 import noclip_exponent, scale_by_pow2

NV_BLOCK = 16
FP8_E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max


def _row_global_scales(global_scale: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Per-row [N, 1] global scale, each partition's own (never collapsed with max)."""
    counts = torch.tensor(sizes, device=global_scale.device)
    return torch.repeat_interleave(global_scale.float().reshape(-1), counts).unsqueeze(1)


def quantize_nvfp4(w: torch.Tensor, partition_sizes=None, power_of_two: bool = False):
    """float [N, K] -> (packed uint8 [N, K/2], scale e4m3 [N, K/16], global_scale fp32 [P]). power_of_two: block
    and global scales powers of two (each block's the one at or above its amax / 6, the largest of a partition
    2^8), which keeps MXFP4's values exact (e2m1 codes times power-of-two block scales) in every block within
    17 binades of its partition's largest; for 16-bit values it is MXFP4 on 16-blocks, worse than the default."""
    check_matrix(w, "w")
    check_k_multiple(w, NV_BLOCK, "NVFP4")
    if not w.is_floating_point():
        raise ValueError(f"quantize_nvfp4 needs a floating-point weight, got {w.dtype}")
    check_finite(w, "w")
    n, k = w.shape
    sizes = check_partitions(n, partition_sizes)
    w = w.float()
    amax = torch.stack([part.abs().amax() if part.numel() else torch.zeros((), device=w.device)
                        for part in torch.split(w, sizes, dim=0)])
    # An all-zero partition gets global scale 1 (any value dequantizes its zero codes to zero). Below
    # amax ~8e-36, 448*6/amax overflows fp32: cap it, the block scales then just use fewer e4m3 steps.
    global_scale = torch.where(amax > 0, FP8_E4M3_MAX * E2M1_MAX / amax, torch.ones_like(amax)).float()
    if power_of_two:  # a block's scale 2^e, the least e with amax <= 6 * 2^e (MXFP4's noclip exponent): the
        # largest of a partition becomes 2^8 (e4m3 holds 2^-9 .. 2^8)
        global_scale = torch.where(amax > 0, scale_by_pow2(torch.ones_like(amax), 8 - noclip_exponent(amax)),
                                   global_scale)
    global_scale = global_scale.clamp(max=FP32_MAX)
    row_gs = _row_global_scales(global_scale, sizes)
    blocks = w.reshape(n, k // NV_BLOCK, NV_BLOCK)
    block_amax = blocks.abs().amax(-1)
    # divisor on the device: CUDA would multiply by a rounded 1/6 instead (scales then differ from the CPU's)
    scale = block_amax / block_amax.new_full((), E2M1_MAX)
    if power_of_two:
        scale = torch.where(block_amax > 0, scale_by_pow2(torch.ones_like(scale), noclip_exponent(block_amax)), scale)
    scale = (scale * row_gs).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    effective = scale.float() / row_gs  # the scale the dequantizer will apply
    safe = torch.where(effective > 0, effective, torch.ones_like(effective))
    codes = round_to_e2m1(blocks / safe.unsqueeze(-1))
    codes = torch.where((effective > 0).unsqueeze(-1), codes, torch.zeros_like(codes))
    return pack_e2m1(codes.reshape(n, k)), scale, global_scale


def check_block_scales(scale: torch.Tensor) -> None:
    """e4m3fn has no inf; its NaN (0x7F / 0xFF) would dequantize a whole block to NaN."""
    check_matrix(scale, "scale")
    nan = torch.isnan(scale.float())
    if bool(nan.any()):
        bad = nan.nonzero()[0].tolist()
        raise ValueError(f"NVFP4 block scale contains NaN (e4m3 0x7F/0xFF), first at [row, block] {bad}")


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     partition_sizes=None) -> torch.Tensor:
    """-> float32 [N, K], each partition divided by its own global scale."""
    check_matrix(packed, "packed")
    check_matrix(scale, "scale")
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 block scale must be float8_e4m3fn, got {scale.dtype}")
    n, half_k = packed.shape
    if (half_k * 2) % NV_BLOCK or scale.shape != (n, half_k * 2 // NV_BLOCK):
        raise ValueError(f"NVFP4 shapes disagree: packed {tuple(packed.shape)} needs scale "
                         f"[{n}, {half_k * 2 // NV_BLOCK}], got {tuple(scale.shape)}")
    global_scale = torch.as_tensor(global_scale, device=packed.device).float().reshape(-1)
    sizes = check_partitions(n, partition_sizes, global_scale.numel())
    if not bool(torch.isfinite(global_scale).all()) or bool((global_scale <= 0).any()):
        raise ValueError(f"NVFP4 global scales must be finite and positive, got {global_scale.tolist()}")
    check_block_scales(scale)
    values = e2m1_to_float(unpack_e2m1(packed)).reshape(n, -1, NV_BLOCK)
    block = scale.float() / _row_global_scales(global_scale, sizes)
    if not bool(torch.isfinite(block * 6).all()):  # a tiny global scale (a divisor) sends the values past float32
        raise ValueError(f"NVFP4 global scales {global_scale.tolist()} make values overflow float32 (block scale / "
                         "global scale x 6 is inf)")
    return (values * block.unsqueeze(-1)).reshape(n, half_k * 2)
