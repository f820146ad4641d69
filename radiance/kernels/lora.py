"""The multi-LoRA delta of a wrapped linear in two Triton launches (radiance.lora.layers.LoraLinear), and their exact
torch references:

    lora_shrink:      shrunk[M, W] = x @ A_all^T, fp32, column c kept only in rows whose slot is c // slot_width
    lora_expand_add:  out[M, N] += shrunk @ B_all^T over each row's own slot's columns, in place, fp32 accumulation
                      and one rounding to out's dtype; rows without an adapter untouched

The slot of each row comes from a device tensor (token_slots, -1: no adapter) read inside both launches, so neither
syncs with the host or has a data-dependent shape: a CUDA graph captures them. x is 16-bit (or fp32), or e4m3
codes with a per-row fp32 scale (the fp8 activations a W4A8 base takes), read as they are: the codes convert
exactly to 16 bits, the dot runs on them and the row's scale multiplies its fp32 sums.

The shrink splits K over programs (grid [M tiles, W tiles, splits]): at decode sizes a single program per output
tile would read all of A alone (128 to 460 KiB at the 8B's sizes), a serial chain of loads, so the splits spread that
read over the SMs; each writes its fp32 partial sums and the tile's last split to arrive (an atomic counter per tile,
re-armed by it) adds them up in split order (deterministic), so the expand reads one [M, W] tile. Prefill sizes tile
M with tl.dot and split K only where the M tiles leave the SMs idle (the counters are then few: at most 2 x SMs).
The expand (grid [M tiles, N tiles]) walks only the columns of the slots its rows use, and multiplies the fp32 sums
with a 16-bit B_all as two 16-bit dots (the value rounded to B's dtype, then what that rounding lost), so the tensor
cores serve it at close to fp32 accuracy; an fp32 B_all takes one exact fp32 dot.

Neither reads the weights of a slot that no row of its tile uses (masked loads: no memory traffic), so a step reads
the adapters it serves, not all max_loras slots.

Both launch as programmatic dependents where the GPU has PDL, and unlike radiance's other kernels they read before
their wait: what the kernel before them (the base GEMM, then the shrink) does not write. The shrink computes all its
sums before it (x, its scales, A, the slots: x was complete before the base GEMM got past its own wait, A and the
slots are written between steps), the expand loads its first B tile (B, the slots); every write, and every read of
the shrunk sums or of out, follows the wait (tests/kernels/test_pdl_protocol.py checks it). So the weights' HBM
latency, which dominates these small launches, runs under the base GEMM's tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radiance.kernels._triton.act_quant import pdl_handoff
from radiance.kernels.buffers import device_buffer
from radiance.kernels.device_info import sm_count, supports_pdl

DECODE_ROWS = 64  # up to this many rows the shrink reads A in 16-row tiles split over K (decode steps)
DECODE_BLOCK_M = 16  # tl.dot's smallest M
PREFILL_BLOCK_M = 64
BLOCK_K = 128
MAX_BLOCK_W = 64
# K splits of the shrink (its last arrival sums them). Swept on the H100, shrink + expand of the 8B's four wrapped
# linears in a graph (bench/RESULTS.md, fifty-eighth session): 4 / 8 / 16 / 32 / 64 splits 10.9 / 7.7 / 6.4 / 6.5 /
# 6.6 us a pair at M 1 (the partials summed by the expand at 8 splits: 8.1)
SHRINK_MAX_SPLITS = 16
EXPAND_BLOCK_N = 64  # 128 above DECODE_ROWS
WAVES = 2  # shrink programs per SM aimed at when splitting K


@triton.jit
def _dot(a, b, acc, INTERPRETER: tl.constexpr):
    """acc + a @ b with fp32 accumulation. The interpreter's bf16 dot returns garbage (Triton 3.9), so there both
    16-bit operands go to fp32 first: exact, the same sums up to their order."""
    if INTERPRETER:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _own_columns(slots, cols, SLOT_WIDTH: tl.constexpr):
    """[rows, cols] whether column c belongs to the row's slot (c // SLOT_WIDTH == slot; never for slot -1)."""
    return slots[:, None] == (cols // SLOT_WIDTH).to(slots.dtype)[None, :]


@triton.jit
def lora_shrink_kernel(x_ptr, scale_ptr, a_ptr, slots_ptr, part_ptr, out_ptr, count_ptr, M, K, W, stride_x, stride_a,
                       k_per_split, splits, SLOT_WIDTH: tl.constexpr, HAS_SCALE: tl.constexpr,
                       FP32_DOT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_K: tl.constexpr, SUM_UNROLL: tl.constexpr = 8, INTERPRETER: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """out[m, c] = sum over k of x[m, k] * A[c, k] (times scale[m] with HAS_SCALE), kept where slots[m] ==
    c // SLOT_WIDTH and 0 elsewhere. x is 16/32-bit or e4m3 (converted exactly to A's dtype); with FP32_DOT both
    are taken to fp32 and multiplied exactly. Grid [cdiv(M, BLOCK_M), cdiv(W, BLOCK_W), splits]; k_per_split a
    multiple of BLOCK_K. With SPLIT each program stores its K range's sums in part[split] and the tile's last to
    arrive (count_ptr: one zeroed counter per tile, left at zero) adds them up in split order into out. A's rows of
    slots no row of the tile uses are not read. The sums are computed before the PDL wait, the writes after it."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    split = tl.program_id(2)
    live_rows = rows < M
    live_cols = cols < W
    rows64 = rows.to(tl.int64)
    slots = tl.load(slots_ptr + rows64, mask=live_rows, other=-1)
    # selected, not multiplied by a 0/1 mask: a row without an adapter gets an exact zero whatever its x holds
    keep = _own_columns(slots, cols, SLOT_WIDTH)
    # A's rows of slots no row of the tile uses are never read: the step reads the adapters it serves, not all slots
    needed = live_cols & (tl.max(keep.to(tl.int32), axis=0) > 0)
    k_start = split * k_per_split
    # a tile without such a column reads nothing at all (its sums are zeros)
    k_end = tl.where(tl.max(needed.to(tl.int32), axis=0) > 0, tl.minimum(k_start + k_per_split, K), k_start)
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        live_k = ks < k_end
        x = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=live_rows[:, None] & live_k[None, :],
                    other=0.0)
        a = tl.load(a_ptr + cols.to(tl.int64)[:, None] * stride_a + ks[None, :],
                    mask=needed[:, None] & live_k[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = _dot(x.to(a.dtype), tl.trans(a), acc, INTERPRETER)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows64, mask=live_rows, other=0.0)[:, None]
    acc = tl.where(keep, acc, 0.0)
    pdl_handoff(PDL)  # every write follows the wait (module docstring)
    tile_offs = rows64[:, None] * W + cols[None, :]
    live = live_rows[:, None] & live_cols[None, :]
    if SPLIT:
        summed = live & needed[None, :]  # the other columns' sums are zeros: neither stored nor read back
        tl.store(part_ptr + split.to(tl.int64) * M * W + tile_offs, acc, mask=summed)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last of the tile's splits: the sum, in split order (deterministic)
            total = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
            for s0 in range(0, splits, SUM_UNROLL):
                for j in tl.static_range(SUM_UNROLL):  # loads issued together, not one round trip each
                    split_offs = tile_offs + (s0 + j) * M * W  # a tensor: the interpreter masks with tensors only
                    total += tl.load(part_ptr + split_offs, mask=summed & (split_offs < splits * M * W), other=0.0,
                                     cache_modifier=".cg")
            tl.store(out_ptr + tile_offs, total, mask=live)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch
    else:
        tl.store(out_ptr + tile_offs, acc, mask=live)


@triton.jit
def _used_b_tile(b_ptr, ns, live_n, cs, slots, stride_b, W, SLOT_WIDTH: tl.constexpr):
    """B^T [len(cs), len(ns)] for columns cs, loaded only where a row of the tile uses the column's slot (zeros
    elsewhere: no memory traffic)."""
    used = tl.max(_own_columns(slots, cs, SLOT_WIDTH).to(tl.int32), axis=0) > 0
    return tl.load(b_ptr + ns.to(tl.int64)[None, :] * stride_b + cs[:, None],
                   mask=(used & (cs < W))[:, None] & live_n[None, :], other=0.0)


@triton.jit
def lora_expand_add_kernel(shrunk_ptr, b_ptr, slots_ptr, out_ptr, M, N, W, stride_b, stride_out,
                           SLOT_WIDTH: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRETER: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    """out[m, n] = round(out[m, n] + sum over the columns c of slot slots[m] of shrunk[m, c] * B[n, c]), the sums in
    fp32 and one rounding to out's dtype; rows of slot -1 are neither read nor written. A 16-bit B multiplies the
    fp32 sums as hi + lo, hi the sums rounded to B's dtype and lo what that lost, in two 16-bit dots; with FP32_DOT
    one exact fp32 dot. Grid [cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)]. The columns walked are those from the lowest to
    the highest slot the tile's rows use (one slot's, in a decode step serving one adapter); the first B tile is
    loaded before the PDL wait, each next one while the current one multiplies."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_rows = rows < M
    live_n = ns < N
    rows64 = rows.to(tl.int64)
    slots = tl.load(slots_ptr + rows64, mask=live_rows, other=-1)
    has_slot = slots >= 0
    # columns [w_lo, w_hi): empty (W, 0) when no row has an adapter
    w_lo = tl.min(tl.where(has_slot, slots, W // SLOT_WIDTH), axis=0) * SLOT_WIDTH
    w_hi = (tl.max(slots, axis=0) + 1) * SLOT_WIDTH
    bt = _used_b_tile(b_ptr, ns, live_n, w_lo + tl.arange(0, BLOCK_W), slots, stride_b, W, SLOT_WIDTH)
    pdl_handoff(PDL)  # the shrunk sums and out are read after the wait (module docstring)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        cs = w0 + tl.arange(0, BLOCK_W)
        own = _own_columns(slots, cs, SLOT_WIDTH) & (cs < W)[None, :]
        shrunk = tl.load(shrunk_ptr + rows64[:, None] * W + cs[None, :], mask=own & live_rows[:, None], other=0.0)
        next_bt = _used_b_tile(b_ptr, ns, live_n, cs + BLOCK_W, slots, stride_b, W, SLOT_WIDTH)  # none past w_hi
        if FP32_DOT:
            acc = tl.dot(shrunk, bt.to(tl.float32), acc, input_precision="ieee")
        else:
            hi = shrunk.to(bt.dtype)
            lo = (shrunk - hi.to(tl.float32)).to(bt.dtype)
            acc = _dot(hi, bt, acc, INTERPRETER)
            acc = _dot(lo, bt, acc, INTERPRETER)
        bt = next_bt
    ptrs = out_ptr + rows64[:, None] * stride_out + ns[None, :]
    live = (live_rows & has_slot)[:, None] & live_n[None, :]
    out = tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
    tl.store(ptrs, (out + acc).to(out_ptr.dtype.element_ty), mask=live)


def _block_w(w: int) -> int:
    return min(MAX_BLOCK_W, max(16, triton.next_power_of_2(w)))


def shrink_splits(m: int, k: int, w: int, device: torch.device) -> tuple[int, int]:
    """(splits, K columns per split) of lora_shrink: enough programs for WAVES per SM, at most SHRINK_MAX_SPLITS, each
    split a whole number of BLOCK_K tiles and none empty."""
    block_m = DECODE_BLOCK_M if m <= DECODE_ROWS else PREFILL_BLOCK_M
    tiles = max(1, -(-m // block_m) * -(-w // _block_w(w)))
    k_tiles = max(1, -(-k // BLOCK_K))
    want = -(-WAVES * sm_count(device) // tiles)
    splits = max(1, min(want, k_tiles, SHRINK_MAX_SPLITS))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per * BLOCK_K


def _check_rows(name: str, t: torch.Tensor, what: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name}: {what} must be a 2-D tensor with contiguous rows, got shape {tuple(t.shape)} "
                         f"and strides {t.stride()}")


def lora_shrink(x: torch.Tensor, a_all: torch.Tensor, token_slots: torch.Tensor, slot_width: int,
                x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """lora_shrink_reference(x, a_all, token_slots, slot_width, x_scale) in one launch: fp32 [M, W], summed in a
    fixed order (deterministic). x [M, K]: 16-bit or fp32, or e4m3 codes with x_scale fp32 [M, 1]; a_all [W, K];
    token_slots [>= M] integer, its first M read on the device."""
    _check_rows("lora_shrink", x, "x")
    _check_rows("lora_shrink", a_all, "a_all")
    m, k = x.shape
    w = a_all.shape[0]
    if a_all.shape[1] != k:
        raise ValueError(f"lora_shrink: x has K={k} but a_all has {a_all.shape[1]} columns")
    if w % slot_width:
        raise ValueError(f"lora_shrink: a_all's {w} rows are not whole slots of {slot_width}")
    fp8 = x.dtype == torch.float8_e4m3fn
    if fp8 != (x_scale is not None):
        raise ValueError(f"lora_shrink: e4m3 x takes a per-row x_scale and other x none, got x {x.dtype} and "
                         f"x_scale {None if x_scale is None else tuple(x_scale.shape)}")
    if token_slots.dim() != 1 or token_slots.shape[0] < m:
        raise ValueError(f"lora_shrink: token_slots needs a slot for each of the {m} rows, got shape "
                         f"{tuple(token_slots.shape)}")
    out = torch.empty((m, w), dtype=torch.float32, device=x.device)
    if m == 0 or w == 0:
        return out
    if x_scale is not None and (x_scale.numel() != m or not x_scale.is_contiguous()):
        raise ValueError(f"lora_shrink: x_scale holds one fp32 scale per row, got shape {tuple(x_scale.shape)}")
    splits, k_per_split = shrink_splits(m, k, w, x.device)
    block_m = DECODE_BLOCK_M if m <= DECODE_ROWS else PREFILL_BLOCK_M
    block_w = _block_w(w)
    grid = (-(-m // block_m), -(-w // block_w), splits)
    part = torch.empty((splits, m, w), dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = (device_buffer("lora-shrink-counters", x.device, max(grid[0] * grid[1], 1024), torch.int32, zeroed=True)
                if splits > 1 else out)
    # e4m3 converts exactly to A's 16 bits; 16-bit x of A's dtype multiplies as it is; anything else in fp32
    fp32_dot = a_all.dtype == torch.float32 or (not fp8 and x.dtype != a_all.dtype)
    pdl = supports_pdl(x.device)
    lora_shrink_kernel[grid](x, x_scale if fp8 else x, a_all, token_slots, part, out, counters, m, k, w,
                             x.stride(0), a_all.stride(0), k_per_split, splits, SLOT_WIDTH=slot_width, HAS_SCALE=fp8,
                             FP32_DOT=fp32_dot, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_W=block_w, BLOCK_K=BLOCK_K,
                             INTERPRETER=not x.is_cuda, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def lora_expand_add(out: torch.Tensor, shrunk: torch.Tensor, b_all: torch.Tensor, token_slots: torch.Tensor,
                    slot_width: int) -> torch.Tensor:
    """lora_expand_add_reference in one launch: out [M, N] += shrunk @ b_all^T over each row's own slot's columns
    (token_slots[:M], read on the device; -1: the row is left as it is), in place, with fp32 sums and one rounding
    to out's dtype; shrunk fp32 [M, W] (lora_shrink's), b_all [N, W]. Returns out."""
    _check_rows("lora_expand_add", out, "out")
    _check_rows("lora_expand_add", b_all, "b_all")
    m, n = out.shape
    w = b_all.shape[1]
    if shrunk.dtype != torch.float32 or shrunk.shape != (m, w) or not shrunk.is_contiguous():
        raise ValueError(f"lora_expand_add: shrunk must be contiguous fp32 [{m}, {w}], got {shrunk.dtype} "
                         f"{tuple(shrunk.shape)}")
    if b_all.shape[0] != n:
        raise ValueError(f"lora_expand_add: out has N={n} but b_all has {b_all.shape[0]} rows")
    if w % slot_width:
        raise ValueError(f"lora_expand_add: b_all's {w} columns are not whole slots of {slot_width}")
    if token_slots.dim() != 1 or token_slots.shape[0] < m:
        raise ValueError(f"lora_expand_add: token_slots needs a slot for each of the {m} rows, got shape "
                         f"{tuple(token_slots.shape)}")
    if m == 0 or n == 0 or w == 0:
        return out
    block_m = DECODE_BLOCK_M if m <= DECODE_ROWS else PREFILL_BLOCK_M
    block_n = EXPAND_BLOCK_N if m <= DECODE_ROWS else 2 * EXPAND_BLOCK_N
    pdl = supports_pdl(out.device)
    grid = (-(-m // block_m), -(-n // block_n))
    lora_expand_add_kernel[grid](shrunk, b_all, token_slots, out, m, n, w, b_all.stride(0), out.stride(0),
                                 SLOT_WIDTH=slot_width, FP32_DOT=b_all.dtype == torch.float32, BLOCK_M=block_m,
                                 BLOCK_N=block_n, BLOCK_W=_block_w(slot_width), INTERPRETER=not out.is_cuda, PDL=pdl,
                                 launch_pdl=pdl, num_warps=4, num_stages=1)  # the walk is a slot's columns: one or
    # a few tiles, each next B tile loaded by hand while the current one multiplies
    return out


def lora_shrink_reference(x: torch.Tensor, a_all: torch.Tensor, token_slots: torch.Tensor, slot_width: int,
                          x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """shrunk fp32 [M, W] = (x, dequantized with x_scale where given) @ a_all^T in fp32, column c zeroed in the
    rows whose slot (token_slots[:M]; -1: no adapter) is not c // slot_width."""
    m = x.shape[0]
    xf = x.float() * x_scale if x_scale is not None else x.float()
    shrunk = xf @ a_all.float().t()
    keep = _own_columns_reference(token_slots[:m], a_all.shape[0], slot_width)
    return torch.where(keep, shrunk, torch.zeros((), device=x.device))


def lora_expand_add_reference(out: torch.Tensor, shrunk: torch.Tensor, b_all: torch.Tensor, token_slots: torch.Tensor,
                              slot_width: int) -> torch.Tensor:
    """out [M, N] = round(out + shrunk @ b_all^T over each row's own slot's columns) in place, in fp32 with one
    rounding to out's dtype; rows whose slot (token_slots[:M]) is -1 keep out as it is. Returns out."""
    m = out.shape[0]
    own = torch.where(_own_columns_reference(token_slots[:m], b_all.shape[1], slot_width), shrunk.float(),
                      torch.zeros((), device=out.device))
    summed = (out.float() + own @ b_all.float().t()).to(out.dtype)
    out.copy_(torch.where(token_slots[:m, None] >= 0, summed, out))
    return out


def _own_columns_reference(row_slots: torch.Tensor, width: int, slot_width: int) -> torch.Tensor:
    """[rows, width] whether column c belongs to the row's slot (_own_columns in torch)."""
    column_slots = torch.arange(width, device=row_slots.device) // slot_width
    return row_slots[:, None].to(column_slots.dtype) == column_slots[None, :]
