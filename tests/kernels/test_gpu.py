"""GPU checks (H200 / any sm_89-sm_90): run with `python -m pytest -m gpu tests/kernels`.

The issue's full M matrix with bf16 outputs against the exact reference, prmt vs arithmetic bytes,
fp8 wgmma in the PTX, and the layer under CUDA graphs and torch.compile."""

import pytest
import torch

from radiance.config import KernelConfig
from radiance.kernels.activation import quantize_activations
from radiance.kernels.prepare import dequantize_prepared, prepare_mxfp4
from radiance.kernels.reference import quantize_activations_reference, relative_error, w4a8_reference
from radiance.kernels.w4a8 import expand_weight_fp8, gemm_ptx, w4a8_gemm
from radiance.layers.linear import Mxfp4Linear, Mxfp4PairLinear, linear_summary
from tests.kernels.conftest import random_mxfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ISSUE_M = (1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 128, 257, 1024, 4096)


# 51200x5120: the 32B's gate_up, whose decode entry tiles K by 512 (tuning/sm90.json)
@pytest.mark.parametrize("n,k", [(48, 96), (4104, 4096), (1024, 14336), (51200, 5120)])
def test_full_m_matrix_bf16(n, k):
    worst = 0.0
    for i, m in enumerate(ISSUE_M):
        packed, scale = random_mxfp4(n, k, "cuda")
        pw = prepare_mxfp4(packed, scale)
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if i % 2 else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4a8_gemm(*quantize_activations(x), pw, bias, out=out)
        ref = w4a8_reference(x, packed, scale, bias)
        err = relative_error(out, ref)
        assert err <= 2e-3 + _one_ulp_flip(ref), f"M={m}: {err:.2e}"
        worst = max(worst, err)
    print(f"N={n} K={k}: worst rel {worst:.2e}")


def _one_ulp_flip(ref: torch.Tensor) -> float:
    """The relative error of one bf16 rounding step going the other way on the largest output: both sides round
    to bf16, so an fp32 difference far below 2e-3 can still land one ulp apart, which in a 48-wide row is up to
    ~4e-3 of its norm (seen in 1% of small-M rows; negligible for thousands of outputs)."""
    amax = ref.abs().max().double()
    return float(torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(amax))) / ref.double().norm())


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


def _silu_mul_one_program_per_row(gate_up):
    """The row kernel, forced (silu_mul spreads small-M rows over several programs on CUDA)."""
    from radiance.kernels._triton.act_quant import silu_mul_rows_kernel
    from radiance.kernels.triton_support import row_launch
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    x_q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device="cuda")
    x_s = torch.empty(m, 1, dtype=torch.float32, device="cuda")
    block, warps = row_launch(inter)
    silu_mul_rows_kernel[(m,)](gate_up, x_q, x_q, x_s, inter, gate_up.stride(0), QUANT=True, BLOCK=block,
                               INTERPRETER=False, num_warps=warps)
    return x_q, x_s


@pytest.mark.parametrize("m,inter", [(1, 14336), (3, 3000), (6, 18944)])
def test_silu_mul_spread_over_programs_matches_row_kernel(m, inter):
    from radiance.kernels.glu import _spread_rows, silu_mul
    gate_up = (torch.randn(m, 2 * inter, device="cuda") * 4).to(torch.bfloat16)
    assert _spread_rows(gate_up, m, inter)
    r_q, r_s = _silu_mul_one_program_per_row(gate_up)
    for _ in range(3):  # the barrier's counters must be re-armed after every launch
        act = silu_mul(gate_up, quantize=True)
        assert torch.equal(act.x_scale, r_s)
        assert torch.equal(act.x_q.view(torch.uint8), r_q.view(torch.uint8))
    if m > 1:  # a NaN in one token changes only that token
        bad = gate_up.clone()
        bad[1, 7] = float("nan")
        act = silu_mul(bad, quantize=True)
        others = [i for i in range(m) if i != 1]
        assert torch.isnan(act.x_scale[1]).all()
        assert torch.equal(act.x_q[others].view(torch.uint8), r_q[others].view(torch.uint8))
    static = gate_up.clone()
    silu_mul(static, quantize=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = silu_mul(static, quantize=True)
    for _ in range(2):
        fresh = (torch.randn_like(gate_up, dtype=torch.float32) * 4).to(torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        f_q, f_s = _silu_mul_one_program_per_row(fresh)
        assert torch.equal(captured.x_q.view(torch.uint8), f_q.view(torch.uint8)) and torch.equal(captured.x_scale, f_s)


def test_fma_division_is_correctly_rounded():
    """divide_by_scale (reciprocal + one FMA correction) against IEEE division, bit for bit: 16M
    quotients over random mantissas, the full range of per-token scales, and |x| <= 448 * scale."""
    import triton
    import triton.language as tl

    from radiance.kernels._triton.act_quant import divide_by_scale

    @triton.jit
    def divide_kernel(x_ptr, s_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        scale = tl.load(s_ptr + row)
        for start in range(0, N, BLOCK):
            x = tl.load(x_ptr + row * N + start + offs)
            tl.store(out_ptr + row * N + start + offs, divide_by_scale(x, scale, False))

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, n = 4096, 4096
    amax = torch.exp2(torch.empty(rows, device="cuda").uniform_(-30, 30, generator=gen))
    scale = torch.clamp(amax / 448.0, min=1.0 / (448.0 * 512.0))
    frac = torch.empty(rows, n, device="cuda").uniform_(-1, 1, generator=gen)
    x = (frac * amax[:, None]).float()
    x[:, :64] = amax[:, None] * torch.linspace(-1, 1, 64, device="cuda")  # the row's extremes too
    out = torch.empty_like(x)
    divide_kernel[(rows,)](x, scale, out, N=n, BLOCK=1024)
    expected = x / scale[:, None]
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


def test_large_activation_quantization_matches_reference_bytes():
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype, k in ((torch.bfloat16, 14336), (torch.float32, 5120), (torch.bfloat16, 17408)):
        x = (torch.randn(512, k, device="cuda", generator=gen)
             * torch.logspace(-4, 4, 512, device="cuda")[:, None]).to(dtype)
        x_q, x_s = quantize_activations(x)
        from radiance.kernels.reference import quantize_activations_reference
        r_q, r_s = quantize_activations_reference(x)
        assert torch.equal(x_s, r_s)
        assert torch.equal(x_q.view(torch.uint8), r_q.view(torch.uint8))


@pytest.mark.parametrize("m", (1, 7, 16, 33, 64, 65, 300))
def test_glu_epilogue_at_the_8b_mlp_shape(m):
    """w4a8_glu on the 8B's gate_up (I = 14336, K = 4096) with the tuning table's tilings: the bytes of
    the GEMM, silu_mul and quantize as separate launches (bf16 output rounding included)."""
    from radiance.kernels.glu import silu_mul
    from radiance.kernels.w4a8 import w4a8_glu

    pw = prepare_mxfp4(*random_mxfp4(2 * 14336, 4096, "cuda"))
    x_q, x_scale = quantize_activations(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) * 3)
    unfused = silu_mul(w4a8_gemm(x_q, x_scale, pw), quantize=True)
    fused_q, fused_s = w4a8_glu(x_q, x_scale, pw)
    assert torch.equal(fused_s, unfused.x_scale)
    assert torch.equal(fused_q.view(torch.uint8), unfused.x_q.view(torch.uint8))


@pytest.mark.parametrize("m", (1, 16, 64, 300))
def test_pair_layer_on_the_kernel(m):
    """Mxfp4PairLinear (the two-term lm_head) on the W4A8 kernel: [x | x] against the exact reference of
    Q1 + Q2, at a head-like shape (N not a multiple of the tile)."""
    packed, scale = random_mxfp4(4104, 2 * 1024, "cuda")
    layer = Mxfp4PairLinear(packed, scale)
    assert layer.path == "w4a8-triton"
    x = (torch.randn(m, 1024, device="cuda") * 2).to(torch.bfloat16)
    x_q, x_s = quantize_activations_reference(x.float())
    expected = (x_q.float() * x_s) @ layer.dequantized_weight().t()
    assert relative_error(layer(x).float(), expected) < 8e-3  # bf16 output rounding
