"""The gated-linear-unit activations of a merged [gate | up] projection, y = act(gate, up), and their torch
reference.

"silu" (Llama, Qwen): silu(gate) * up.
"swiglu_oai" (OpenAI's gpt-oss, as HF transformers computes it):
    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    y = (up + 1) * (gate * sigmoid(gate * alpha))
"gelu_tanh" (Gemma's GeGLU, transformers' gelu_pytorch_tanh): gelu(gate, approximate="tanh") * up.

glu_reference computes them with torch ops in the input's dtype, each op rounded to it as torch rounds (the
math of one op in fp32). The Triton GLU epilogue (_triton/gemm.py, _triton/act_quant.py) applies the same ops
with the same roundings to the GEMM's gate and up rounded to the output dtype, so it gives glu_reference of
the rounded GEMM output, up to the fp32 ulps in which Triton's exp and torch's sigmoid may differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
