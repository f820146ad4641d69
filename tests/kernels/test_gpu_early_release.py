"""Early PDL release (triton_support.PDL_EARLY_RELEASE) changes when the GEMM after a norm launches, never what it
reads: a captured GEMM -> norm -> GEMM chain (deferred partials, the norm quantizing) with the norm releasing
early replays to the bytes of the eager chain without it. GPU only (the interpreter has no PDL)."""

import pytest
import torch

import radiance.kernels.triton_support as triton_support
from radiance.kernels.activation import quantize_activations
from radiance.kernels.norm import add_rmsnorm
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.w4a8 import w4a8_gemm, w4a8_gemm_partials
from tests.kernels.conftest import random_mxfp4

pytestmark = pytest.mark.gpu


def _chain(x, residual, norm_w, w_o, w_qkv):
    parts = w4a8_gemm_partials(*quantize_activations(x), w_o)
    y, summed = add_rmsnorm(parts, residual, norm_w, 1e-5, quantize=True)
    return w4a8_gemm(y.x_q, y.x_scale, w_qkv), summed


@pytest.mark.parametrize("m", [1, 8])
def test_early_released_norm_in_a_graph_gives_the_eager_bytes(m, monkeypatch):
    hidden = 4096
    w_o = prepare_mxfp4(*random_mxfp4(hidden, hidden, "cuda"))
    w_qkv = prepare_mxfp4(*random_mxfp4(6144, hidden, "cuda"))
    norm_w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    static_x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    static_r = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(triton_support, "PDL_EARLY_RELEASE", frozenset({"norm", "parts_quantize"}))
    _chain(static_x, static_r, norm_w, w_o, w_qkv)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_sum = _chain(static_x, static_r, norm_w, w_o, w_qkv)
    monkeypatch.setattr(triton_support, "PDL_EARLY_RELEASE", frozenset())
    for _ in range(3):
        x, r = torch.randn_like(static_x), torch.randn_like(static_r)
        static_x.copy_(x)
        static_r.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        out, summed = _chain(x, r, norm_w, w_o, w_qkv)
        assert torch.equal(static_sum, summed)
        assert torch.equal(static_out, out)
