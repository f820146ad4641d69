"""GPU checks (H200 / any sm_89-sm_90): run with `python -m pytest -m gpu tests/kernels`.

The issue's full M matrix with bf16 outputs against the exact reference, prmt vs arithmetic bytes,
fp8 wgmma in the PTX, and the layer under CUDA graphs and torch.compile."""

import pytest
import torch

from radiance.config import KernelConfig
from radiance.kernels.activation import quantize_activations
from radiance.kernels.prepare import dequantize_prepared, prepare_mxfp4
from radiance.kernels.reference import relative_error, w4a8_reference
from radiance.kernels.w4a8 import expand_weight_fp8, gemm_ptx, w4a8_gemm
from radiance.layers.linear import Mxfp4Linear, linear_summary
from tests.kernels.conftest import random_mxfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ISSUE_M = (1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 128, 257, 1024, 4096)


@pytest.mark.parametrize("n,k", [(48, 96), (4104, 4096), (1024, 14336)])
def test_full_m_matrix_bf16(n, k):
    worst = 0.0
    for i, m in enumerate(ISSUE_M):
        packed, scale = random_mxfp4(n, k, "cuda")
        pw = prepare_mxfp4(packed, scale)
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if i % 2 else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4a8_gemm(*quantize_activations(x), pw, bias, out=out)
        err = relative_error(out, w4a8_reference(x, packed, scale, bias))
        assert err <= 2e-3, f"M={m}: {err:.2e}"
        worst = max(worst, err)
    print(f"N={n} K={k}: worst rel {worst:.2e}")


def test_prmt_and_arithmetic_expansion_agree():
    packed, scale = random_mxfp4(512, 2048, "cuda", spread=14)
    pw = prepare_mxfp4(packed, scale)
    a = expand_weight_fp8(pw, use_asm=True)
    assert torch.equal(a.view(torch.uint8), expand_weight_fp8(pw, use_asm=False).view(torch.uint8))
    assert torch.equal(a.float() * pw.w_scale[:, None], dequantize_prepared(pw))


def test_ptx_has_fp8_wgmma():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is sm_90 only")
    pw = prepare_mxfp4(*random_mxfp4(4096, 4096, "cuda"))
    for m in (16, 4096):
        ptx = gemm_ptx(*quantize_activations(torch.randn(m, 4096, device="cuda")), pw)
        assert any("wgmma" in line and "e4m3" in line for line in ptx.splitlines()), f"M={m}: no fp8 wgmma"
        assert "prmt" in ptx


def test_layer_under_cuda_graph_and_compile():
    packed, scale = random_mxfp4(384, 512, "cuda")
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    layer = Mxfp4Linear(packed, scale, bias, KernelConfig(numerics_check=True, numerics_check_every=1), name="t")
    assert layer.path == "w4a8-triton" and linear_summary(torch.nn.ModuleList([layer])).startswith("1/1")
    for m in (4, 300):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        eager = layer(x)
        assert layer.monitor.failures == 0 and layer.monitor.checks > 0
        assert relative_error(eager, w4a8_reference(x, packed, scale, bias)) <= 2e-3
        static_x = x.clone()
        layer(static_x)  # warm-up outside capture (compiles the kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        fresh = torch.randn_like(x)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(fresh))
        compiled = torch.compile(layer, fullgraph=True)
        assert torch.equal(compiled(x), eager)
