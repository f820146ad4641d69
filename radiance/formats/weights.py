"""Weight containers: one linear's weight in one of the five formats, with its partitions.

Every reader produces these and every consumer (kernels, writers, inspect) takes them, so the
formats meet in one place. `partition_sizes` records the rows of each original projection inside
a merged linear (q/k/v, gate/up); NVFP4 keeps one global scale per partition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from radiance.formats._checks import check_partitions
from radiance.formats.fp8 import dequantize_fp8_per_channel
from radiance.formats.int4 import INT4_GROUP, dequantize_int4
from radiance.formats.mxfp4 import MX_BLOCK, dequantize_mxfp4
from radiance.formats.nvfp4 import NV_BLOCK, dequantize_nvfp4
from radiance.formats.requant import dense_to_mxfp4, nvfp4_to_mxfp4, requant_rows_to_mxfp4


def _sizes(partition_sizes, n: int) -> tuple[int, ...]:
    return check_partitions(n, partition_sizes)


@dataclass
class DenseWeight:
    tensor: torch.Tensor  # [N, K] bf16 / fp16 / fp32
    partition_sizes: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    format = "dense"

    def __post_init__(self):
        if self.tensor.dim() != 2:
            raise ValueError(f"dense weight must be 2-D, got shape {tuple(self.tensor.shape)}")
        self.partition_sizes = _sizes(self.partition_sizes, self.tensor.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tensor.shape)  # type: ignore[return-value]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"tensor": self.tensor}


@dataclass
class Mxfp4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # uint8 e8m0 [N, K/32]
    partition_sizes: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    format = "mxfp4"

    def __post_init__(self):
        n, half_k = self.packed.shape
        if self.packed.dtype != torch.uint8 or self.scale.dtype != torch.uint8:
            raise ValueError(f"MXFP4 weight needs uint8 packed and scale, got {self.packed.dtype}, {self.scale.dtype}")
        if tuple(self.scale.shape) != (n, half_k * 2 // MX_BLOCK):
            raise ValueError(f"MXFP4 scale shape {tuple(self.scale.shape)} does not match packed {tuple(self.packed.shape)}")
        self.partition_sizes = _sizes(self.partition_sizes, n)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale": self.scale}


@dataclass
class Nvfp4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # fp32 [P], a divisor
    partition_sizes: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    format = "nvfp4"

    def __post_init__(self):
        n, half_k = self.packed.shape
        if self.packed.dtype != torch.uint8 or self.scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"NVFP4 weight needs uint8 packed and float8_e4m3fn scale, got {self.packed.dtype}, {self.scale.dtype}")
        if tuple(self.scale.shape) != (n, half_k * 2 // NV_BLOCK):
            raise ValueError(f"NVFP4 scale shape {tuple(self.scale.shape)} does not match packed {tuple(self.packed.shape)}")
        self.global_scale = self.global_scale.float().reshape(-1)
        self.partition_sizes = check_partitions(n, self.partition_sizes, self.global_scale.numel())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale": self.scale, "global_scale": self.global_scale}


@dataclass
class Fp8Weight:
    w8: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N, 1], or with block_k [N, ceil(K / block_k)] (a block's scale on each of its rows)
    partition_sizes: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    block_k: int = 0  # K per scale of a block-scaled weight (128 in the published checkpoints); 0: one per row
    format = "fp8"

    def __post_init__(self):
        if self.w8.dtype != torch.float8_e4m3fn or self.w8.dim() != 2:
            raise ValueError(f"FP8 weight must be 2-D float8_e4m3fn, got {self.w8.dtype} {tuple(self.w8.shape)}")
        n, k = self.w8.shape
        if self.block_k:
            self.scale = self.scale.float()
            groups = -(-k // self.block_k)
            if tuple(self.scale.shape) != (n, groups):
                raise ValueError(f"FP8 block scales must be [{n}, {groups}], got {tuple(self.scale.shape)}")
        else:
            self.scale = self.scale.float().reshape(-1, 1) if self.scale.numel() == n else self.scale.float()
            if self.scale.numel() not in (1, n):
                raise ValueError(f"FP8 scale must be per-channel or per-tensor, got {tuple(self.scale.shape)}")
        self.partition_sizes = _sizes(self.partition_sizes, n)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w8.shape)  # type: ignore[return-value]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w8": self.w8, "scale": self.scale}


@dataclass
class Int4Weight:
    """Affine 4-bit codes, one scale and one offset per 32 weights along K: w = code * scale + offset.

    GGUF's Q4_0 (offset = -8 * scale), Q4_1 and Q4_K read into this form without rounding.
    """

    packed: torch.Tensor  # uint8 [N, K/2], low nibble = even k
    scale: torch.Tensor  # fp32 [N, K/32]
    offset: torch.Tensor  # fp32 [N, K/32]
    partition_sizes: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    format = "int4"

    def __post_init__(self):
        n, half_k = self.packed.shape
        if self.packed.dtype != torch.uint8:
            raise ValueError(f"int4 weight needs uint8 packed codes, got {self.packed.dtype}")
        groups = (n, half_k * 2 // INT4_GROUP)
        if tuple(self.scale.shape) != groups or tuple(self.offset.shape) != groups:
            raise ValueError(f"int4 scale {tuple(self.scale.shape)} / offset {tuple(self.offset.shape)} do not match "
                             f"packed {tuple(self.packed.shape)}")
        self.partition_sizes = _sizes(self.partition_sizes, n)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scale": self.scale, "offset": self.offset}


Weight = DenseWeight | Mxfp4Weight | Nvfp4Weight | Fp8Weight | Int4Weight


def nbytes(weight: Weight) -> int:
    return sum(t.numel() * t.element_size() for t in weight.tensors().values())


def weight_to(weight: Weight, device) -> Weight:
    return replace(weight, **{k: v.to(device) for k, v in weight.tensors().items()})


def concat_partitions(weights: list[Weight]) -> Weight:
    """Merge projections that share an input (q/k/v, gate/up) into one weight along N.

    Partitions are recorded, never collapsed: NVFP4 keeps every global scale, FP8 every channel
    scale. All parts must have the same format and K.
    """
    if not weights:
        raise ValueError("concat_partitions needs at least one weight")
    fmt = {w.format for w in weights}
    ks = {w.shape[1] for w in weights}
    if len(fmt) != 1 or len(ks) != 1:
        raise ValueError(f"cannot merge weights of formats {sorted(fmt)} and K {sorted(ks)}")
    sizes = tuple(p for w in weights for p in w.partition_sizes)
    first = weights[0]
    blocks = {w.block_k for w in weights if isinstance(w, Fp8Weight) and w.block_k}
    if len(blocks) > 1:
        raise ValueError(f"cannot merge FP8 weights of K blocks {sorted(blocks)}")
    if blocks:  # a part small enough for one block reads as per-tensor: its scale repeats over the K blocks
        block_k = blocks.pop()
        groups = -(-first.shape[1] // block_k)
        scales = [w.scale if w.block_k else w.scale.expand(w.shape[0], 1).expand(w.shape[0], groups) for w in weights]
        return Fp8Weight(torch.cat([w.w8 for w in weights]), torch.cat(scales), sizes, block_k)
    if isinstance(first, Fp8Weight) and any(w.scale.numel() == 1 for w in weights):
        # per-tensor scales become per-channel so the merged weight still has one scale per row
        scales = [w.scale.expand(w.shape[0], 1) if w.scale.numel() == 1 else w.scale for w in weights]
        return Fp8Weight(torch.cat([w.w8 for w in weights]), torch.cat(scales), sizes)
    merged = {name: torch.cat([w.tensors()[name] for w in weights]) for name in first.tensors()}
    return type(first)(**merged, partition_sizes=sizes)


def scaled(weight: Weight, factor: float) -> Weight:
    """The weight times `factor`, folded into its scales where it has them (Granite's residual multiplier): dense
    values in float32, FP8 and int4 scales (and offsets), NVFP4's global divisor; MXFP4's power-of-two block scales
    take a power of two only (a ValueError otherwise)."""
    if isinstance(weight, DenseWeight):
        return replace(weight, tensor=weight.tensor.float() * factor)
    if isinstance(weight, Fp8Weight):
        return replace(weight, scale=weight.scale * factor)
    if isinstance(weight, Int4Weight):
        return replace(weight, scale=weight.scale * factor, offset=weight.offset * factor)
    if isinstance(weight, Nvfp4Weight):
        return replace(weight, global_scale=weight.global_scale / factor)
    if isinstance(weight, Mxfp4Weight):
        mantissa, exponent = math.frexp(factor)
        if mantissa != 0.5:
            raise ValueError(f"an MXFP4 weight scales exactly by a power of two only, not {factor}")
        shifted = weight.scale.int() + (exponent - 1)
        if (shifted < 0).any() or (shifted > 254).any():
            raise ValueError(f"scaling by {factor} takes MXFP4 block exponents out of the e8m0 range")
        return replace(weight, scale=shifted.to(torch.uint8))
    raise ValueError(f"not a weight: {type(weight).__name__}")


def rows_reordered(weight: Weight, order: torch.Tensor) -> Weight:
    """The weight with its output rows in `order` (row i of the result is row order[i]), exactly in every format: its
    codes and per-row scales move with the rows. Each partition's rows must stay within it (an NVFP4 partition's
    global scale, a per-tensor FP8 scale apply to all of its rows)."""
    n = weight.shape[0]
    order = order.to(torch.long)
    if sorted(order.tolist()) != list(range(n)):
        raise ValueError(f"not a permutation of the weight's {n} rows")
    start = 0
    for size in weight.partition_sizes:
        part = order[start:start + size]
        if size and (int(part.min()) < start or int(part.max()) >= start + size):
            raise ValueError("a row order must keep each partition's rows within it")
        start += size
    moved = {}
    for key, tensor in weight.tensors().items():
        per_row = tensor.dim() >= 1 and tensor.shape[0] == n and key != "global_scale"
        moved[key] = tensor.index_select(0, order.to(tensor.device)) if per_row else tensor
    return replace(weight, **moved)


def dequantize(weight: Weight) -> torch.Tensor:
    """float32 [N, K] values of any weight."""
    if isinstance(weight, DenseWeight):
        return weight.tensor.float()
    if isinstance(weight, Mxfp4Weight):
        return dequantize_mxfp4(weight.packed, weight.scale)
    if isinstance(weight, Nvfp4Weight):
        return dequantize_nvfp4(weight.packed, weight.scale, weight.global_scale, weight.partition_sizes)
    if isinstance(weight, Fp8Weight):
        return dequantize_fp8_per_channel(weight.w8, weight.scale, weight.block_k)
    if isinstance(weight, Int4Weight):
        return dequantize_int4(weight.packed, weight.scale, weight.offset)
    raise ValueError(f"not a weight: {type(weight).__name__}")


def to_mxfp4(weight: Weight, rule: str = "mse", chunk_rows: int | None = None) -> tuple[Mxfp4Weight, float]:
    """Any weight -> (Mxfp4Weight with the same partitions, relRMS of the conversion)."""
    sizes = weight.partition_sizes
    if isinstance(weight, Mxfp4Weight):
        return weight, 0.0
    if isinstance(weight, Nvfp4Weight):
        p, s, err = nvfp4_to_mxfp4(weight.packed, weight.scale, weight.global_scale, sizes, rule, chunk_rows)
    elif isinstance(weight, Fp8Weight):
        n, k = weight.shape
        per_row = weight.scale.numel() > 1

        def rows(a: int, b: int) -> torch.Tensor:
            return dequantize_fp8_per_channel(weight.w8[a:b], weight.scale[a:b] if per_row else weight.scale,
                                              weight.block_k)

        p, s, err = requant_rows_to_mxfp4(rows, n, k, weight.w8.device, rule, chunk_rows)
    elif isinstance(weight, DenseWeight):
        p, s, err = dense_to_mxfp4(weight.tensor, rule, chunk_rows)
    elif isinstance(weight, Int4Weight):
        def int4_rows(a: int, b: int) -> torch.Tensor:  # one chunk of rows at a time: the fp32 copy stays bounded
            return dequantize_int4(weight.packed[a:b], weight.scale[a:b], weight.offset[a:b])

        p, s, err = requant_rows_to_mxfp4(int4_rows, *weight.shape, weight.packed.device, rule, chunk_rows)
    else:
        raise ValueError(f"not a weight: {type(weight).__name__}")
    return Mxfp4Weight(p, s, sizes), err
