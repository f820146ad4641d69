"""Input validation shared by the codecs: every problem is a ValueError that names it."""

from __future__ import annotations

import torch


def check_matrix(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(t.shape)}")


def check_k_multiple(t: torch.Tensor, multiple: int, fmt: str) -> None:
    if t.shape[1] % multiple:
        raise ValueError(f"{fmt} needs K (the last dimension) to be a multiple of {multiple}, got K={t.shape[1]}")


def nonfinite_count(tensor: torch.Tensor) -> int:
    """How many NaN / inf values `tensor` holds. Its sum is non-finite exactly when some value is (or, rarely,
    when finite values add up past the dtype's range: the exact count then decides). One read pass, a tenth of
    isfinite().all() on a CPU."""
    if not tensor.is_floating_point():
        return 0
    if tensor.element_size() == 1:  # torch sums no fp8 dtypes
        tensor = tensor.float()
    if bool(torch.isfinite(tensor.sum())):
        return 0
    return int((~torch.isfinite(tensor)).sum())


def check_finite(t: torch.Tensor, name: str, row_offset: int = 0) -> None:
    """Refuse NaN / inf; `row_offset` makes the reported index absolute when `t` is a chunk of rows."""
    if not t.is_floating_point():
        return
    if t.element_size() == 1:  # torch has no isfinite for the fp8 dtypes
        t = t.float()
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        if bad:
            bad[0] += row_offset
        raise ValueError(f"{name} contains NaN or inf (first at index {bad}); refusing to quantize it")


def check_partitions(n_rows: int, partition_sizes, n_global: int | None = None) -> tuple[int, ...]:
    """Validate partition sizes against N rows (and the number of global scales when given)."""
    sizes = (n_rows,) if partition_sizes is None else tuple(int(p) for p in partition_sizes)
    if any(p <= 0 for p in sizes) or sum(sizes) != n_rows:
        raise ValueError(f"partition_sizes {sizes} must be positive and sum to N={n_rows}")
    if n_global is not None and n_global != len(sizes):
        raise ValueError(f"{n_global} global scale(s) for {len(sizes)} partition(s) {sizes}")
    return sizes


# the largest e8m0 scale byte whose blocks stay finite in float32 (and bfloat16): 6 x 2^125 < 2^128 <= 4 x 2^126
MX_SCALE_MAX_BYTE = 252


def check_mxfp4_pair(packed, scale) -> None:
    """An MXFP4 weight's two tensors agree: uint8 codes [N, K/2], uint8 e8m0 scales [N, K/32], no NaN scale."""
    check_matrix(packed, "packed")
    check_matrix(scale, "scale")
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 needs uint8 packed codes and uint8 e8m0 scales, got {packed.dtype} and {scale.dtype}")
    n, half_k = packed.shape
    if (half_k * 2) % 32 or tuple(scale.shape) != (n, half_k * 2 // 32):
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)} needs scale "
                         f"[{n}, {half_k * 2 // 32}] and K a multiple of 32, got scale {tuple(scale.shape)}")
    if scale.numel() and int(scale.max()) == 255:
        raise ValueError("MXFP4 scale contains 0xFF (the e8m0 NaN encoding)")
    if scale.numel() and int(scale.max()) > MX_SCALE_MAX_BYTE:
        bad = (scale > MX_SCALE_MAX_BYTE).nonzero()[0].tolist()
        raise ValueError(f"MXFP4 scale byte {int(scale.max())} (2^{int(scale.max()) - 127}) at [row, block] {bad}: "
                         "its values (up to 6 x that) overflow float32")
