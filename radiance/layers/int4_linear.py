"""Int4Linear: 4-bit GGUF linears (Q4_0 / Q4_1 / Q4_K) served on a CPU straight from their codes.

Decode on a CPU reads every weight once per token, so weight bytes are the time: 4.5 bits per weight
here against 32 for the float32 dequantized weight. The kernel is PyTorch's own int4 CPU GEMM
(`aten._weight_int4pack_mm_for_cpu`, the one torchao's int4 weight-only path uses). It computes
w = (code - 8) * scale + zero per 32 weights along K from bfloat16 activations, scales and zeros, sums
in fp32 and rounds the result to bfloat16; the layer returns it in the model's dtype. Its cost grows
with M like a GEMV's (no reuse across rows), which is the decode case it is for.
"""

from __future__ import annotations

import torch
from torch import nn

from radiance.formats import INT4_GROUP, Int4Weight, unpack_e2m1

PATH_INT4_CPU = "int4-cpu"
_N_MULTIPLE = 16  # the kernel packs output rows in groups of 16


def int4_cpu_unsupported(weight: Int4Weight, device: torch.device) -> str | None:
    """Why the int4 CPU kernel cannot serve `weight` on `device`, or None when it can."""
    if device.type != "cpu":
        return f"{device.type}: the int4 kernel is a CPU kernel"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no int4 CPU kernel"
    if weight.shape[0] % _N_MULTIPLE:
        return f"{weight.shape[0]} output rows are not a multiple of {_N_MULTIPLE}"
    return None


class Int4Linear(nn.Module):
    """y = x @ W^T for an Int4Weight, on the CPU (see the module docstring for the numerics)."""

    path = PATH_INT4_CPU
    path_reason = "4-bit GGUF codes on the CPU int4 kernel (bfloat16 activations)"

    def __init__(self, weight: Int4Weight, name: str = ""):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.name = name
        # Plain attributes, not buffers: the kernel needs them exactly as packed here (a model.to(dtype) or
        # .float() turned the bfloat16 scales into fp32 and every call failed), and reading a buffer goes
        # through Module.__getattr__ (~0.5 us, twice per call, 120 calls per SmolLM2 token).
        codes = unpack_e2m1(weight.packed).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zero = weight.offset.float() + 8.0 * weight.scale.float()  # the kernel subtracts 8 from every code
        scale_zero = torch.stack([weight.scale.float().t(), zero.t()], dim=-1)  # [K/32, N, 2]
        self.scale_zero = scale_zero.to(torch.bfloat16).contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, path={self.path}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # reshape(-1, K) would silently regroup the rows of a wrong K
            raise ValueError(f"{self.name or 'int4 linear'}: input has {x.shape[-1]} features, "
                             f"the weight takes {self.in_features}")
        flat = x.dim() == 2  # the engine's [tokens, hidden]: no views to make (~1 us each at decode)
        x2 = x if flat else x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16 or not x2.is_contiguous():  # conversions only when needed: ops cost
            x2 = x2.to(torch.bfloat16).contiguous()               # ~2 us each at decode on a CPU
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scale_zero)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)
