"""The W4A8 linear as one opaque torch op (`torch.ops.radiance.w4a8_linear`).

torch.compile sees a single node with a fake (meta) implementation; the M-band routing and launch
choices happen inside, on concrete shapes, so no Python branch depends on a traced value. Eager code
(and CUDA-graph capture) calls the `_impl` functions directly: the custom-op dispatcher costs more host
time per call than the kernels' launches.
"""

from __future__ import annotations

import torch

from radiance.kernels.activation import quantize_activations
from radiance.kernels.glu import GluActivation
from radiance.kernels.prepare import PreparedMxfp4
from radiance.kernels.w4a8 import w4a8_gemm, w4a8_glu


def _prepared(w_q, w_shift, w_scale, in_features: int) -> PreparedMxfp4:
    return PreparedMxfp4(w_q, w_shift, w_ref=w_scale.new_empty(0, dtype=torch.int32), w_scale=w_scale,
                         in_features=in_features, underflow_blocks=0)


def w4a8_linear_impl(x: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, decode_band: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> [M, N] in x.dtype: per-token fp8 quantization + W4A8 GEMM."""
    x_q, x_scale = quantize_activations(x)
    return w4a8_gemm(x_q, x_scale, _prepared(w_q, w_shift, w_scale, x.shape[1]), bias, x.dtype, decode_band=decode_band)


def w4a8_linear_quantized_impl(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor,
                               w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                               decode_band: int) -> torch.Tensor:
    """Pre-quantized activations (from the fused norm / SiLU-mul kernels) -> [M, N] in out_dtype."""
    return w4a8_gemm(x_q, x_scale, _prepared(w_q, w_shift, w_scale, x_q.shape[1]), bias, out_dtype,
                     decode_band=decode_band)


@torch.library.custom_op("radiance::w4a8_linear", mutates_args=())
def w4a8_linear(x: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, decode_band: int) -> torch.Tensor:
    return w4a8_linear_impl(x, w_q, w_shift, w_scale, bias, decode_band)


@w4a8_linear.register_fake
def _w4a8_linear_fake(x, w_q, w_shift, w_scale, bias, decode_band):
    return x.new_empty((x.shape[0], w_q.shape[0]))


@torch.library.custom_op("radiance::w4a8_linear_quantized", mutates_args=())
def w4a8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor,
                          w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                          decode_band: int) -> torch.Tensor:
    return w4a8_linear_quantized_impl(x_q, x_scale, w_q, w_shift, w_scale, bias, out_dtype, decode_band)


@w4a8_linear_quantized.register_fake
def _w4a8_linear_quantized_fake(x_q, x_scale, w_q, w_shift, w_scale, bias, out_dtype, decode_band):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)


def w4a8_glu_quantized_impl(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor,
                            w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                            decode_band: int, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """A merged [gate | up] W4A8 linear, then act(gate) * up (rounded to out_dtype; `act` a GLU kind of
    w4a8.DENSE_GLU_KINDS), quantized per token: (x_q e4m3 [M, N/2], x_scale [M, 1]) for the down projection
    (w4a8.w4a8_glu)."""
    return w4a8_glu(x_q, x_scale, _prepared(w_q, w_shift, w_scale, x_q.shape[1]), bias, out_dtype,
                    decode_band=decode_band, activation=GluActivation(act))


@torch.library.custom_op("radiance::w4a8_glu_quantized", mutates_args=())
def w4a8_glu_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_shift: torch.Tensor,
                       w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                       decode_band: int, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    return w4a8_glu_quantized_impl(x_q, x_scale, w_q, w_shift, w_scale, bias, out_dtype, decode_band, act)


@w4a8_glu_quantized.register_fake
def _w4a8_glu_quantized_fake(x_q, x_scale, w_q, w_shift, w_scale, bias, out_dtype, decode_band, act="silu"):
    m = x_q.shape[0]
    return (x_q.new_empty((m, w_q.shape[0] // 2)), x_scale.new_empty((m, 1)))
