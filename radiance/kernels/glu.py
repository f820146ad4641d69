"""The gated-linear-unit activations of a merged [gate | up] projection, y = act(gate, up), their torch
reference, and the launchers of their Triton kernel (`glu_mul`, `silu_mul`: optionally quantized to per-token fp8).

"silu" (Llama, Qwen): silu(gate) * up.
"swiglu_oai" (OpenAI's gpt-oss, as HF transformers computes it):
    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    y = (up + 1) * (gate * sigmoid(gate * alpha))
"gelu_tanh" (Gemma's GeGLU, transformers' gelu_pytorch_tanh): gelu(gate, approximate="tanh") * up.

glu_reference computes them with torch ops in the input's dtype, each op rounded to it as torch rounds (the
math of one op in fp32). The Triton GLU epilogue (_triton/gemm.py, _triton/act_quant.py) applies the same ops
with the same roundings to the GEMM's gate and up rounded to the output dtype, so it gives glu_reference of
the rounded GEMM output, up to the fp32 ulps in which Triton's exp and torch's sigmoid may differ.
glu_mul and silu_mul apply the same ops in a Triton kernel of their own on CUDA (or any device under the Triton
interpreter); elsewhere glu_reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radiance.kernels import reference
from radiance.kernels._triton import act_quant as _act
from radiance.kernels.activation import Fp8Activations, fp8_outputs
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.kernels.triton_support import (CHUNK, MAX_ROW, as_rows, next_pow2, row_barrier_buffers, row_launch,
                                             triton_serves)

# the kernels' ACT code of each kind is its index here
GLU_KINDS = ("silu", "swiglu_oai", "gelu_tanh")


@dataclass(frozen=True)
class GluActivation:
    kind: str = "silu"  # one of GLU_KINDS
    alpha: float = 1.702  # swiglu_oai only: the sigmoid's slope
    limit: float = 7.0  # swiglu_oai only: the clamp of gate (above) and up (both sides); config "swiglu_limit"

    def __post_init__(self):
        if self.kind not in GLU_KINDS:
            raise ValueError(f"GluActivation: kind must be one of {GLU_KINDS}, not {self.kind!r}")

    @property
    def kernel_code(self) -> int:
        """The GLU epilogue's ACT constexpr."""
        return GLU_KINDS.index(self.kind)

    def kernel_constexprs(self) -> dict:
        """The GLU kernels' ACT, ALPHA, LIMIT; silu keeps their defaults, so one compile serves it whatever
        alpha and limit say."""
        if self.kind == "silu":
            return {}
        if self.kind == "gelu_tanh":
            return dict(ACT=self.kernel_code)
        return dict(ACT=self.kernel_code, ALPHA=self.alpha, LIMIT=self.limit)


SILU = GluActivation()
GELU_TANH = GluActivation("gelu_tanh")
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")  # config.json's names of it (transformers' ACT2FN, Gemma's)


def glu_reference(gate_up: torch.Tensor, act: GluActivation) -> torch.Tensor:
    """[..., 2I] in [gate | up] order -> [..., I], computed in gate_up's dtype as torch/HF does."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def _spread_rows(t: torch.Tensor, m: int, k: int) -> bool:
    """Whether a row of k elements is better spread over several programs: on CUDA, when the rows
    alone would leave most SMs idle and the whole grid fits on the GPU at once (its spin barrier
    needs every program of a row resident)."""
    if not t.is_cuda or k <= 2 * CHUNK:
        return False
    return m * -(-k // CHUNK) <= sm_count(t.device)


def silu_mul(gate_up: torch.Tensor, quantize: bool = False):
    """silu(gate) * up for gate_up = [gate | up] along the last dim, rounded as torch does in the
    input dtype; Fp8Activations when `quantize`. One Triton kernel on CUDA; torch elsewhere."""
    return glu_mul(gate_up, SILU, quantize)


def glu_mul(gate_up: torch.Tensor, activation: GluActivation, quantize: bool = False, *,
            bias: torch.Tensor | None = None, row_expert: torch.Tensor | None = None):
    """silu_mul for any GLU activation: glu_reference(gate_up, activation), the same roundings, in one
    Triton kernel on CUDA (the activation's kernel_constexprs); torch elsewhere. `bias` [E, 2I] with
    `row_expert` (int [M]): row r's gate and up get bias[row_expert[r]] added first, in gate_up's dtype (the
    expert biases of expert-sorted rows, without a [M, 2I] bias tensor)."""
    g2 = as_rows(gate_up)
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
    block, warps = row_launch(inter)
    _act.silu_mul_rows_kernel[(m,)](g2, y, x_q, x_scale, inter, g2.stride(0), QUANT=quantize, BLOCK=block,
                                    INTERPRETER=not g2.is_cuda, PDL=pdl, launch_pdl=pdl,
                                    num_warps=warps, **act)
    return Fp8Activations(x_q, x_scale, gate_up.dtype, lead) if quantize else y.reshape(*lead, inter)
