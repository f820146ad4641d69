"""Launchers for per-token fp8 activation quantization (plain and fused with RMSNorm).

On CUDA (or any device under the Triton interpreter) they run the Triton kernels; elsewhere the
torch reference, which computes the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radiance import env
from radiance.kernels import reference
from radiance.kernels._triton import act_quant as _act
from radiance.kernels.buffers import device_buffer
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.kernels.glu import SILU, GluActivation, glu_reference
from radiance.kernels.tuning import next_pow2

MAX_ROW = 65536  # one row lives in registers
CHUNK = 1024  # elements per program when a row is spread over several (silu_mul at decode)
MANY_ROWS = 1024  # rows from which quantize_activations launches small programs (prefill sizes, measured)
FEW_ROWS = 8  # up to this many rows the norm summing split-K partials runs 32 warps per row


def triton_serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors on t's device (CUDA, or the CPU interpreter)."""
    return t.is_cuda or env.triton_interpret()


def _row_launch(k: int, m: int = 1) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-program-per-row kernel over m rows of k elements."""
    block = max(next_pow2(k), 16)
    if m >= MANY_ROWS:
        # many programs per SM: small ones overlap one another's load, reduce and store phases
        # (H200, 4096 x 4096: 19.4 -> 14.8 us; bench/RESULTS.md, eighth session)
        return block, 4 if block <= 8192 else 8
    # 16 warps from 4096 elements on: at decode a row is one program, and fewer warps leave the SM's
    # schedulers idle on the reduction and division latencies
    return block, max(1, min(16, block // 256))


def _spread_rows(t: torch.Tensor, m: int, k: int) -> bool:
    """Whether a row of k elements is better spread over several programs: on CUDA, when the rows
    alone would leave most SMs idle and the whole grid fits on the GPU at once (its spin barrier
    needs every program of a row resident)."""
    if not t.is_cuda or k <= 2 * CHUNK:
        return False
    return m * -(-k // CHUNK) <= sm_count(t.device)


def row_barrier_buffers(device: torch.device, rows: int, parties: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax slots int32 [rows * parties], arrival counts int64 [rows]) for kernels whose programs
    agree on a row's scale (act_quant.shared_row_scale). The counts only grow, by `parties` per
    launch, so each party count keeps its own zero-initialised array."""
    rows = max(rows, 1024)
    return (device_buffer(f"row-amax-slots-{parties}", device, rows * parties, torch.int32, zeroed=True),
            device_buffer(f"row-arrivals-{parties}", device, rows, torch.int64, zeroed=True))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q e4m3 [M, K], x_scale fp32 [M, 1]) with M the product of the leading dims."""
    x2 = _as_rows(x)
    m, k = x2.shape
    if not triton_serves(x2) or k > MAX_ROW or m == 0:
        return reference.quantize_activations_reference(x2)
    x_q, x_scale = fp8_outputs(m, k, x2.device)
    block, warps = _row_launch(k, m)
    pdl = supports_pdl(x2.device)
    if block > 4096 and 4 * block > 5 * k:  # padding to a power of two would waste over 20%
        chunk, warps = (2048, warps) if m >= MANY_ROWS else (4096, 16)  # many rows: _row_launch's warps
        _act.quantize_rows_chunked_kernel[(m,)](x2, x_q, x_scale, k, x2.stride(0), BLOCK=chunk,
                                                INTERPRETER=not x2.is_cuda, PDL=pdl, launch_pdl=pdl,
                                                num_warps=warps)
    else:
        _act.quantize_rows_kernel[(m,)](x2, x_q, x_scale, k, x2.stride(0), BLOCK=block,
                                         INTERPRETER=not x2.is_cuda, PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return x_q, x_scale


class Fp8Activations(NamedTuple):
    """Per-token e4m3 activations ready for a W4A8 linear, made by a fused norm or SiLU-mul kernel:
    x_q [M, K], x_scale fp32 [M, 1]; the linear's output takes `dtype` and the leading shape `lead`.
    `values`: the `dtype` tensor [*lead, K] they quantize, where the producer kept it too (add_rmsnorm's
    keep_values: a sparse MLP's router reads it, its experts the e4m3 codes)."""

    x_q: torch.Tensor
    x_scale: torch.Tensor
    dtype: torch.dtype
    lead: tuple[int, ...]
    values: torch.Tensor | None = None


class PartialSums(NamedTuple):
    """A W4A8 GEMM's output [M, N] left as its fp32 split-K partials, parts [S, M, W >= N], for the kernel
    that reads it next to sum (add_rmsnorm): output = parts[0] + parts[1] + ... (columns :N), added in
    that order in fp32 and rounded to `dtype`, the bytes of the GEMM's own last-arrival sum. `lead`: the
    output's leading shape (w4a8.w4a8_gemm_partials)."""

    parts: torch.Tensor
    width: int
    dtype: torch.dtype
    lead: tuple[int, ...]

    def total(self) -> torch.Tensor:
        """The output itself, [*lead, N] in dtype."""
        total = torch.zeros_like(self.parts[0, :, :self.width])
        for part in self.parts:
            total += part[:, :self.width]
        return total.to(self.dtype).reshape(*self.lead, self.width)


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


def fp8_outputs(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (x_q e4m3 [m, k], x_scale fp32 [m, 1]) for a kernel that quantizes m tokens."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def add_rmsnorm(x: torch.Tensor | PartialSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                quantize: bool = False, keep_values: bool = False, launch: str = "norm"):
    """One kernel for a decoder layer's pre-norm: (y, s) with s = x + residual (x when residual is
    None) and y = weight * rms_norm(s), rounded as the model's RMSNorm does; y is Fp8Activations when
    `quantize`, holding y itself as `values` too with `keep_values`. x may be a GEMM's PartialSums, summed
    as the kernel reads them (the bytes of their total); without a residual their sum is not kept (s is None:
    Gemma's norms of the attention and MLP outputs). Triton on CUDA (and under the interpreter); the torch
    reference elsewhere. `launch` names the norm for PDL_EARLY_RELEASE."""
    parts = None
    if isinstance(x, PartialSums):
        if not triton_serves(x.parts) or x.width > MAX_ROW or x.parts.shape[1] == 0:
            x = x.total()
        elif x.parts.stride(2) != 1:
            raise ValueError("add_rmsnorm: partials need contiguous rows")
        else:
            parts = x
    if parts is not None:  # the kernel reads [S, M, W] fp32 rows
        x2, (m, k), dtype, lead = parts.parts, (parts.parts.shape[1], parts.width), parts.dtype, parts.lead
    else:
        x2 = _as_rows(x)
        (m, k), dtype, lead = x2.shape, x.dtype, tuple(x.shape[:-1])
    if weight.shape != (k,):
        raise ValueError(f"add_rmsnorm: weight shape {tuple(weight.shape)} does not match hidden size {k}")
    r2 = _as_rows(residual) if residual is not None else None
    if parts is None and (not triton_serves(x2) or k > MAX_ROW or m == 0):
        s = x2 + r2 if r2 is not None else x2
        y = reference.rms_normalize_reference(s, weight, eps)
        out = Fp8Activations(*reference.quantize_activations_reference(y), x.dtype, lead,
                             y.reshape(x.shape) if keep_values else None) if quantize else y.reshape(x.shape)
        return out, s.reshape(x.shape)
    keeps_sum = r2 is not None or parts is None
    if r2 is not None:
        s = torch.empty((m, k), dtype=dtype, device=x2.device)
    else:  # partials without a residual: an empty s only tells the kernel the dtype their sum is rounded to
        s = x2 if parts is None else torch.empty((0,), dtype=dtype, device=x2.device)
    keep_values = quantize and keep_values
    y = s.new_empty((0,)) if quantize and not keep_values else torch.empty((m, k), dtype=dtype, device=x2.device)
    x_q, x_scale = fp8_outputs(m, k, x2.device) if quantize else (y, y)
    block, warps = _row_launch(k)
    if parts is not None and m <= FEW_ROWS:
        warps = 32  # one SM reads all of a row's partials: the most loads in flight (8B decode step -17 us)
    pdl = supports_pdl(x2.device)
    _act.add_rmsnorm_rows_kernel[(m,)](
        x2, r2 if r2 is not None else x2, weight.contiguous(), y, s, x_q, x_scale, k, x2.stride(-2),
        r2.stride(0) if r2 is not None else 0, float(eps), x2.stride(0) if parts is not None else 0,
        HAS_RESIDUAL=r2 is not None, QUANT=quantize, PARTS=x2.shape[0] if parts is not None else 0, BLOCK=block,
        INTERPRETER=not x2.is_cuda, PDL=pdl, KEEP_VALUES=keep_values, EARLY_RELEASE=releases_early(launch, pdl),
        launch_pdl=pdl, num_warps=warps)
    shape = (*lead, k)
    out = (Fp8Activations(x_q, x_scale, dtype, lead, y.reshape(shape) if keep_values else None) if quantize
           else y.reshape(shape))
    return out, (s.reshape(shape) if keeps_sum else None)


def silu_mul(gate_up: torch.Tensor, quantize: bool = False):
    """silu(gate) * up for gate_up = [gate | up] along the last dim, rounded as torch does in the
    input dtype; Fp8Activations when `quantize`. One Triton kernel on CUDA; torch elsewhere."""
    return glu_mul(gate_up, SILU, quantize)


def glu_mul(gate_up: torch.Tensor, activation: GluActivation, quantize: bool = False, *,
            bias: torch.Tensor | None = None, row_expert: torch.Tensor | None = None):
    """silu_mul for any GLU activation: glu.glu_reference(gate_up, activation), the same roundings, in one
    Triton kernel on CUDA (the activation's kernel_constexprs); torch elsewhere. `bias` [E, 2I] with
    `row_expert` (int [M]): row r's gate and up get bias[row_expert[r]] added first, in gate_up's dtype (the
    expert biases of expert-sorted rows, without a [M, 2I] bias tensor)."""
    g2 = _as_rows(gate_up)
    m, two_i = g2.shape
    inter = two_i // 2
    lead = tuple(gate_up.shape[:-1])
    pdl = supports_pdl(g2.device)
    if (bias is None) != (row_expert is None):
        raise ValueError("glu_mul: bias and row_expert go together")
    act = activation.kernel_constexprs()
    if bias is not None:
        act.update(bias_ptr=bias.contiguous(), expert_ptr=row_expert.contiguous(), HAS_BIAS=True)
    if not triton_serves(g2) or inter > MAX_ROW or m == 0:
        if bias is not None:
            g2 = g2 + bias.to(g2.dtype)[row_expert.long()]
        y = glu_reference(g2, activation)
        if quantize:
            return Fp8Activations(*reference.quantize_activations_reference(y), gate_up.dtype, lead)
        return y.reshape(*lead, inter)
    if quantize and _spread_rows(g2, m, inter):
        x_q, x_scale = fp8_outputs(m, inter, g2.device)
        chunks = -(-inter // CHUNK)
        slots, count = row_barrier_buffers(g2.device, m, chunks)
        operands = dict(bias_ptr=g2, expert_ptr=g2)  # placeholders unless act carries a bias
        operands.update(act)
        _act.silu_mul_quant_chunks_kernel[(chunks, m)](g2, x_q, x_scale, slots, count, I=inter,
                                                       stride_m=g2.stride(0), BLOCK=CHUNK,
                                                       C_PAD=next_pow2(chunks), PDL=pdl, launch_pdl=pdl,
                                                       num_warps=4, **operands)
        return Fp8Activations(x_q, x_scale, gate_up.dtype, lead)
    y = g2.new_empty((0,)) if quantize else g2.new_empty((m, inter))
    x_q, x_scale = fp8_outputs(m, inter, g2.device) if quantize else (y, y)
    block, warps = _row_launch(inter)
    _act.silu_mul_rows_kernel[(m,)](g2, y, x_q, x_scale, inter, g2.stride(0), QUANT=quantize, BLOCK=block,
                                    INTERPRETER=not g2.is_cuda, PDL=pdl, launch_pdl=pdl,
                                    num_warps=warps, **act)
    return Fp8Activations(x_q, x_scale, gate_up.dtype, lead) if quantize else y.reshape(*lead, inter)


def quantize_rows_from_parts(y: torch.Tensor, amax_parts: torch.Tensor,
                             launch: str = "parts_quantize") -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations(y) for y [M, K] whose row amax the kernel that wrote it left in amax_parts
    (int32 bits [M, P] of |y| maxima over column tiles: w4a8_glu's GEMM): one fully parallel launch,
    M * cdiv(K, CHUNK) programs, none waiting for another. Triton only (CUDA or the interpreter).
    `launch` names it for PDL_EARLY_RELEASE: "parts_quantize" / "prefill_parts_quantize" before a dense GEMM in /
    above the decode band, "moe_parts_quantize" before a grouped one."""
    m, k = y.shape
    x_q, x_scale = fp8_outputs(m, k, y.device)
    if m == 0:
        return x_q, x_scale
    pdl = supports_pdl(y.device)
    parts = amax_parts.shape[1]
    _act.quantize_rows_from_parts_kernel[(m * -(-k // CHUNK),)](
        y, amax_parts, x_q, x_scale, k, parts, y.stride(0), BLOCK=CHUNK, P_PAD=max(2, next_pow2(parts)),
        INTERPRETER=not y.is_cuda, PDL=pdl, EARLY_RELEASE=releases_early(launch, pdl),
        launch_pdl=pdl, num_warps=4)
    return x_q, x_scale


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RMSNorm + per-token fp8 quantization: quantize_activations(weight * rms_norm(x))."""
    act, _ = add_rmsnorm(x, None, weight, eps, quantize=True)
    return act.x_q, act.x_scale
