"""The W4A8 GEMM (both tilings, split-K, bias, ragged N/K) and the fused op vs the exact reference.
Run on CUDA, or on the CPU through the Triton interpreter by test_triton_interpreter.py."""

import pytest
import torch

from radiance.formats import dequantize_mxfp4
from radiance.kernels import ops  # also registers torch.ops.radiance.*
from radiance.kernels.activation import Fp8Activations, quantize_activations
from radiance.kernels.glu import GELU_TANH, SILU, GluActivation, glu_mul, silu_mul
from radiance.kernels.norm import PartialSums, add_rmsnorm
from radiance.kernels.prepare import dequantize_prepared, prepare_mxfp4
from radiance.kernels.reference import quantize_activations_reference, relative_error, w4a8_matmul_reference
from radiance.kernels.tuning import GemmConfig
from radiance.kernels.w4a8 import expand_weight_fp8, w4a8_gemm, w4a8_gemm_partials, w4a8_glu
from tests.kernels.conftest import random_mxfp4

# The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even), so exactness is
# checked on fp32 outputs; bf16 is checked on the GPU (test_gpu.py).
GATE = 2e-3
ISSUE_M = (1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 128, 257, 1024, 4096)
SWAP = GemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=True, split_k=0)
PLAIN = GemmConfig(block_m=64, block_n=32, block_k=128, swap_ab=False, split_k=1)
SPLIT3 = GemmConfig(block_m=16, block_n=32, block_k=128, swap_ab=True, split_k=3)
# the tiling class of the M <= 256 prefill entries (tuning/sm90.json): wide token tile, block_k 256
WIDE_M = GemmConfig(block_m=128, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=3, split_k=2)
# the tiling class of the 32B gate_up's decode entry: four 128-k word groups per K tile
DEEP_K = GemmConfig(block_m=16, block_n=64, block_k=512, swap_ab=True, num_warps=4, num_stages=3, split_k=1)


def assert_same_quantized_rows(device, got, want):
    """Two routes to the same fp8 rows (x_q, x_scale), e.g. the GLU epilogue vs GEMM + silu_mul + quantize.
    On CUDA the bytes are equal. Under the interpreter tl.dot is numpy's matmul, whose summation order
    depends on where a row sits in the tile: the GLU tile (gate and up rows interleaved) and the plain one
    then differ in a few accumulators by 1-4 fp32 ulps (seen: 3 of 2800, which moved one row's amax and
    scale by an ulp), so there an ulp of scale and one e4m3 step per code are allowed."""
    (got_q, got_s), (want_q, want_s) = got, want
    if device.type == "cuda":
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        return
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    codes_differ = got_q.view(torch.uint8) != want_q.view(torch.uint8)
    assert codes_differ.float().mean() <= 0.01
    torch.testing.assert_close(got_q.float() * got_s, want_q.float() * want_s, rtol=2 ** -3, atol=0)


def _check(device, m, n, k, config, bias: bool, spread: int = 5, out_dtype=torch.float32, gate=GATE):
    packed, scale = random_mxfp4(n, k, device, spread=spread)
    pw = prepare_mxfp4(packed, scale)
    x = torch.randn(m, k, device=device) * 2
    b = torch.randn(n, device=device) if bias else None
    x_q, x_scale = quantize_activations(x)
    out = torch.full((m, n), float("nan"), device=device, dtype=out_dtype)  # poisoned
    w4a8_gemm(x_q, x_scale, pw, b, out_dtype, config=config, out=out)
    ref = w4a8_matmul_reference(*quantize_activations_reference(x), dequantize_prepared(pw), b, torch.float32)
    err = relative_error(out, ref)
    assert err <= gate, f"M={m} N={n} K={k} {config}: rel {err:.2e}"
    if pw.underflow_blocks == 0:  # then the prepared weight is the MXFP4 weight itself
        assert torch.equal(dequantize_prepared(pw), dequantize_mxfp4(packed, scale))


def test_expand_arithmetic_gives_exact_weight(device):
    packed, scale = random_mxfp4(40, 256, device, spread=14)
    pw = prepare_mxfp4(packed, scale)
    w8 = expand_weight_fp8(pw, use_asm=False)
    assert torch.equal(w8.float() * pw.w_scale[:, None], dequantize_prepared(pw))


@pytest.mark.parametrize("m", ISSUE_M)
def test_default_dispatch_every_m_band(device, m):
    _check(device, m, 48, 96, None, bias=m % 2 == 1)


@pytest.mark.parametrize("config", [SWAP, PLAIN, SPLIT3, DEEP_K], ids=["swap", "plain", "split3", "deep_k"])
@pytest.mark.parametrize("m", (1, 5, 17, 70))
def test_tilings_with_ragged_n_and_k(device, config, m):
    # N not a tile multiple, K not a multiple of BK (5 K tiles of 128; 2 of 512, the second 32 columns live)
    _check(device, m, 40, 544, config, bias=True)


@pytest.mark.parametrize("m", (100, 257))
def test_wide_token_tile_over_several_m_tiles(device, m):
    _check(device, m, 80, 768, WIDE_M, bias=m % 2 == 1)  # ragged M and N tiles, 3 K tiles over 2 splits


def test_wide_exponent_spread_and_underflow(device):
    _check(device, 9, 64, 128, SWAP, bias=False, spread=16)


def test_bf16_out_and_empty_m(device):
    packed, scale = random_mxfp4(32, 64, device)
    pw = prepare_mxfp4(packed, scale)
    x_q, x_s = quantize_activations(torch.randn(0, 64, device=device))
    assert w4a8_gemm(x_q, x_s, pw).shape == (0, 32)
    x = torch.randn(4, 64, device=device)
    out = w4a8_gemm(*quantize_activations(x), pw)
    assert out.dtype == torch.bfloat16
    ref = w4a8_matmul_reference(*quantize_activations_reference(x), dequantize_prepared(pw), None, torch.float32)
    assert relative_error(out, ref) < 8e-3  # bf16 output rounding (truncation under the interpreter)


def test_nan_token_does_not_leak_into_other_rows(device):
    packed, scale = random_mxfp4(48, 128, device)
    pw = prepare_mxfp4(packed, scale)
    for m, config in ((5, SWAP), (70, PLAIN)):
        x = torch.randn(m, 128, device=device)
        clean = w4a8_gemm(*quantize_activations(x), pw, None, torch.float32, config=config)
        x[2, 3] = float("nan")
        x[4, 7] = float("inf")
        out = w4a8_gemm(*quantize_activations(x), pw, None, torch.float32, config=config)
        keep = [i for i in range(m) if i not in (2, 4)]
        assert torch.equal(out[keep], clean[keep])
        assert not torch.isfinite(out[2]).all()


def test_custom_op_matches_reference_and_traces(device):
    packed, scale = random_mxfp4(48, 96, device)
    pw = prepare_mxfp4(packed, scale)
    x = torch.randn(6, 96, device=device)
    args = (x, pw.w_q, pw.w_shift, pw.w_scale, None, 64)
    out = torch.ops.radiance.w4a8_linear(*args)
    ref = w4a8_matmul_reference(*quantize_activations_reference(x), dequantize_prepared(pw), None, torch.float32)
    assert out.dtype == x.dtype and relative_error(out, ref) <= GATE
    compiled = torch.compile(lambda *a: torch.ops.radiance.w4a8_linear(*a) * 2, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(*args), out * 2)
    torch.library.opcheck(torch.ops.radiance.w4a8_linear.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    x_q, x_s = quantize_activations(x)
    out_q = torch.ops.radiance.w4a8_linear_quantized(x_q, x_s, pw.w_q, pw.w_shift, pw.w_scale, None, torch.float32, 64)
    assert torch.equal(out_q, out)
    # eager layers call the implementations directly (no dispatcher): the same function
    assert torch.equal(ops.w4a8_linear_impl(*args), out)
    out_q2 = ops.w4a8_linear_quantized_impl(x_q, x_s, pw.w_q, pw.w_shift, pw.w_scale, None, torch.float32, 64)
    assert torch.equal(out_q2, out)


@pytest.mark.parametrize("bias", [False, True])
def test_large_m_expand_path_matches_reference(device, monkeypatch, bias):
    """From the table's expand_min_m on, w4a8_gemm expands the weight to e4m3 (the Triton expansion
    kernel) and calls the fp8 scaled matmul; routed here by lowering the threshold."""
    from radiance.kernels import w4a8

    monkeypatch.setattr(w4a8, "expand_min_m", lambda dev: 8)
    m, n, k = 20, 48, 288  # K not a multiple of 128: the padded word groups
    packed, scale = random_mxfp4(n, k, device, spread=9)
    pw = prepare_mxfp4(packed, scale)
    x = torch.randn(m, k, device=device) * 2
    b = torch.randn(n, device=device) if bias else None
    x_q, x_scale = quantize_activations(x)
    out = w4a8_gemm(x_q, x_scale, pw, b, torch.float32)
    ref = w4a8_matmul_reference(*quantize_activations_reference(x), dequantize_prepared(pw), b, torch.float32)
    assert relative_error(out, ref) <= GATE
    calls = []
    monkeypatch.setattr(w4a8, "_expand_then_fp8_mm", lambda *a: calls.append(a) or out)
    w4a8_gemm(x_q[:7], x_scale[:7], pw, b, torch.float32)  # below the threshold: the fused kernel
    w4a8_gemm(x_q, x_scale, pw, b, torch.float32)
    assert len(calls) == 1


def _glu_pair(device, m, inter, k, bias, config, out_dtype, activation=SILU):
    """(glu_mul(w4a8_gemm(...), activation, quantize=True), w4a8_glu(...)) on one random [gate | up] weight."""
    packed, scale = random_mxfp4(2 * inter, k, device)
    pw = prepare_mxfp4(packed, scale)
    x = torch.randn(m, k, device=device) * 2
    b = torch.randn(2 * inter, device=device) if bias else None
    x_q, x_scale = quantize_activations(x)
    unfused = glu_mul(w4a8_gemm(x_q, x_scale, pw, b, out_dtype, config=config), activation, quantize=True)
    return unfused, w4a8_glu(x_q, x_scale, pw, b, out_dtype, config=config, activation=activation)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [SWAP, PLAIN, SPLIT3, None], ids=["swap", "plain", "split3", "table"])
@pytest.mark.parametrize("m", (1, 5, 17, 64, 70))
def test_glu_epilogue_gives_the_unfused_bytes(device, config, m, out_dtype):
    """The gate_up GEMM with silu(gate) * up in its epilogue, then the quantize launch from the tiles'
    amax parts: the bytes of the GEMM, silu_mul and quantize as three steps. I = 40 leaves the last
    column tile half empty; K = 544 is no multiple of the K tile."""
    unfused, (x_q, x_scale) = _glu_pair(device, m, 40, 544, m % 2 == 1, config, out_dtype)
    assert x_q.shape == (m, 40) and x_scale.shape == (m, 1)
    assert_same_quantized_rows(device, (x_q, x_scale), (unfused.x_q, unfused.x_scale))


@pytest.mark.parametrize("config", [SWAP, SPLIT3, None], ids=["swap", "split3", "table"])
@pytest.mark.parametrize("m", (1, 17, 70))
def test_geglu_epilogue_gives_the_unfused_bytes(device, config, m):
    """Gemma's GeGLU in the gate_up GEMM's epilogue (ACT 2): the bytes of the GEMM, the GeGLU launch and the
    quantize as three steps, and far from the SiLU epilogue's rows on the same inputs."""
    pw = prepare_mxfp4(*random_mxfp4(80, 544, device))
    x_q, x_scale = quantize_activations(torch.randn(m, 544, device=device) * 2)
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fused = w4a8_glu(x_q, x_scale, pw, None, out_dtype, config=config, activation=GELU_TANH)
    unfused = glu_mul(w4a8_gemm(x_q, x_scale, pw, None, out_dtype, config=config), GELU_TANH, quantize=True)
    assert_same_quantized_rows(device, fused, (unfused.x_q, unfused.x_scale))
    silu = w4a8_glu(x_q, x_scale, pw, None, out_dtype, config=config)  # the large gates agree; the negative don't
    assert (silu[0].float() != fused[0].float()).float().mean() > 0.2
    with pytest.raises(ValueError, match="dense GLU epilogue"):
        w4a8_glu(x_q, x_scale, pw, None, out_dtype, activation=GluActivation("swiglu_oai"))


def test_glu_nan_token_stays_in_its_row(device):
    packed, scale = random_mxfp4(96, 128, device)
    pw = prepare_mxfp4(packed, scale)
    x = torch.randn(5, 128, device=device)
    clean_q, clean_s = w4a8_glu(*quantize_activations(x), pw, None, torch.float32, config=SPLIT3)
    x[2, 3] = float("nan")
    x_q, x_s = w4a8_glu(*quantize_activations(x), pw, None, torch.float32, config=SPLIT3)
    keep = [0, 1, 3, 4]
    assert torch.equal(x_q[keep].view(torch.uint8), clean_q[keep].view(torch.uint8))
    assert torch.equal(x_s[keep], clean_s[keep]) and torch.isnan(x_s[2]).all()


def test_glu_expand_path_and_custom_op(device, monkeypatch):
    """From expand_min_m on, w4a8_glu is the expanded GEMM then silu_mul; the custom op traces and
    matches the eager implementation."""
    from radiance.kernels import w4a8

    packed, scale = random_mxfp4(64, 256, device)
    pw = prepare_mxfp4(packed, scale)
    x_q, x_scale = quantize_activations(torch.randn(12, 256, device=device))
    fused = w4a8_glu(x_q, x_scale, pw, None, torch.float32)
    monkeypatch.setattr(w4a8, "expand_min_m", lambda dev: 8)
    expanded = w4a8_glu(x_q, x_scale, pw, None, torch.float32)
    unfused = silu_mul(w4a8_gemm(x_q, x_scale, pw, None, torch.float32), quantize=True)
    assert_same_quantized_rows(device, expanded, (unfused.x_q, unfused.x_scale))
    monkeypatch.undo()
    args = (x_q, x_scale, pw.w_q, pw.w_shift, pw.w_scale, None, torch.float32, 64)
    op_q, op_s = torch.ops.radiance.w4a8_glu_quantized(*args)
    assert torch.equal(op_q.view(torch.uint8), fused[0].view(torch.uint8)) and torch.equal(op_s, fused[1])
    # (test_schema compares fp8 tensors with an op the CPU lacks for them)
    torch.library.opcheck(torch.ops.radiance.w4a8_glu_quantized.default, args, test_utils=("test_faketensor",))
    compiled = torch.compile(lambda *a: torch.ops.radiance.w4a8_glu_quantized(*a)[1] * 2, backend="aot_eager",
                             fullgraph=True)
    assert torch.equal(compiled(*args), fused[1] * 2)
    gelu_q, gelu_s = torch.ops.radiance.w4a8_glu_quantized(*args, "gelu_tanh")  # Gemma's GeGLU through the op
    want_q, want_s = w4a8_glu(x_q, x_scale, pw, None, torch.float32, activation=GELU_TANH)
    assert torch.equal(gelu_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(gelu_s, want_s)
    with pytest.raises(ValueError, match="even row count"):
        w4a8_glu(x_q, x_scale, prepare_mxfp4(*random_mxfp4(63, 256, device)))


def _summed(out):
    return out.total() if isinstance(out, PartialSums) else out


@pytest.mark.parametrize("config, splits", [(SPLIT3, 3), (PLAIN, 1), (SWAP, None)], ids=["split3", "one", "auto"])
@pytest.mark.parametrize("m", (1, 5, 17))
def test_gemm_partials_sum_to_the_gemm_output(device, m, config, splits):
    """w4a8_gemm_partials leaves fp32 split-K partials whose sum in split order, rounded, is the bytes of
    w4a8_gemm (its last-arrival sum); one split leaves the fp32 output as the one partial."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # see GATE's note on bf16
    pw = prepare_mxfp4(*random_mxfp4(200, 768, device))  # N ragged against every tile
    x_q, x_scale = quantize_activations(torch.randn(m, 768, device=device))
    want = w4a8_gemm(x_q, x_scale, pw, None, dtype, config=config)
    got = w4a8_gemm_partials(x_q, x_scale, pw, dtype, config=config)
    assert got.parts.dtype == torch.float32 and got.parts.shape[1] == m and got.parts.shape[2] >= 200
    if splits is not None:
        assert got.parts.shape[0] == splits
    assert got.width == 200 and got.dtype == dtype and got.lead == (m,)
    assert torch.equal(got.total(), want)


@pytest.mark.parametrize("quantize", [False, True])
def test_add_rmsnorm_sums_partials_as_the_gemm_does(device, quantize):
    """add_rmsnorm over PartialSums (the kernel sums them as it reads) gives the bytes of add_rmsnorm over
    their total; leading dims come from the partials."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k, m = 576, 6
    parts = torch.randn(4, m, 640, device=device) * 3  # rows wider than k, as a GEMM's tiles leave them
    partial = PartialSums(parts, k, dtype, (2, 3))
    residual = (torch.randn(2, 3, k, device=device) * 3).to(dtype)
    weight = (torch.rand(k, device=device) + 0.5).to(dtype)
    y, s = add_rmsnorm(partial, residual, weight, 1e-5, quantize=quantize)
    y_want, s_want = add_rmsnorm(partial.total(), residual, weight, 1e-5, quantize=quantize)
    assert s.shape == (2, 3, k) and torch.equal(s, s_want)
    if quantize:
        assert isinstance(y, Fp8Activations) and y.lead == (2, 3) and y.dtype == dtype
        assert torch.equal(y.x_scale, y_want.x_scale)
        assert torch.equal(y.x_q.view(torch.uint8), y_want.x_q.view(torch.uint8))
    else:
        assert torch.equal(y, y_want)
    # without a residual (Gemma's norm of an attention or MLP output): the same y, and no sum kept
    y, s = add_rmsnorm(partial, None, weight, 1e-5, quantize=quantize)
    y_want, _ = add_rmsnorm(partial.total(), None, weight, 1e-5, quantize=quantize)
    assert s is None
    if quantize:
        assert torch.equal(y.x_q.view(torch.uint8), y_want.x_q.view(torch.uint8)) and y.lead == (2, 3)
    else:
        assert y.shape == (2, 3, k) and torch.equal(y, y_want)


@pytest.mark.parametrize("m", (3, 70))
def test_norm_after_a_deferring_linear_matches_the_summing_gemm(device, monkeypatch, m):
    """A W4A8 linear feeding a residual-add RMSNorm (llama.for_norm): at decode sizes it leaves PartialSums
    (KernelConfig.defer_split_sum) and the norm's outputs are the bytes of the GEMM summing itself."""
    from radiance.config import KernelConfig
    from radiance.layers import linear as linear_module
    from radiance.layers.linear import Mxfp4Linear
    from radiance.layers.norm import RMSNorm
    from radiance.models import llama

    monkeypatch.setattr(linear_module, "choose_path", lambda dev, cfg: (linear_module.PATH_W4A8, "test"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = random_mxfp4(64, 512, device)
    act = Fp8Activations(*quantize_activations(torch.randn(m, 512, device=device)), dtype, (m,))
    residual = torch.randn(m, 64, device=device).to(dtype)
    norm = RMSNorm(64).to(device=device, dtype=dtype)
    outs = {}
    for defer in (True, False):
        layer = Mxfp4Linear(*weight, kernel_config=KernelConfig(defer_split_sum=defer))
        x = llama.for_norm(layer, act)
        assert isinstance(x, PartialSums) == (defer and m <= 64)
        y, s = norm(x, residual, fp8=True)
        outs[defer] = (y.x_q.view(torch.uint8), y.x_scale, s)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


@pytest.mark.parametrize("m", (3, 70))
def test_mlp_takes_the_fused_route_with_the_unfused_result(device, monkeypatch, m):
    """LlamaMLP with W4A8 gate_up and down: with KernelConfig.fuse_glu the SiLU runs in the gate_up
    GEMM's epilogue (no glu_mul call), without it as its own launch; the outputs are identical."""
    from types import SimpleNamespace

    from radiance.config import KernelConfig
    from radiance.layers import linear as linear_module
    from radiance.layers.linear import Mxfp4Linear
    from radiance.models import llama

    monkeypatch.setattr(linear_module, "choose_path", lambda dev, cfg: (linear_module.PATH_W4A8, "test"))
    silu_calls = []
    monkeypatch.setattr(llama, "glu_mul", lambda *a, **kw: silu_calls.append(1) or glu_mul(*a, **kw))
    gate_up, down = random_mxfp4(192, 64, device), random_mxfp4(64, 96, device)
    x = torch.randn(m, 64, device=device)
    outputs = {}
    for fuse in (True, False):
        mlp = llama.LlamaMLP(SimpleNamespace(hidden_size=64, intermediate_size=96, mlp_activation=SILU))
        mlp.gate_up_proj = Mxfp4Linear(*gate_up, kernel_config=KernelConfig(fuse_glu=fuse))
        mlp.down_proj = Mxfp4Linear(*down)
        out = mlp(x)
        # at decode sizes down_proj leaves its partials for the norm after it (KernelConfig.defer_split_sum)
        assert isinstance(out, PartialSums) == (m <= 64)
        outputs[fuse] = _summed(out)
        assert len(silu_calls) == (0 if fuse else 1)
    if device.type == "cuda":
        assert torch.equal(outputs[True], outputs[False])
    else:  # an ulp apart in the GLU accumulators under the interpreter (assert_same_quantized_rows)
        assert relative_error(outputs[True], outputs[False]) <= 1e-2


def test_glu_shapes_the_table_keeps_unfused(device, monkeypatch):
    """A gate_up shape listed in the tuning table's unfused_glu_shapes runs the GEMM, then silu_mul,
    with the same bytes as the fused epilogue."""
    from radiance.kernels import w4a8

    pw = prepare_mxfp4(*random_mxfp4(96, 256, device))
    x_q, x_scale = quantize_activations(torch.randn(3, 256, device=device))
    fused = w4a8_glu(x_q, x_scale, pw, None, torch.float32)
    launches = []
    monkeypatch.setattr(w4a8, "glu_epilogue_serves", lambda n, k, dev: launches.append((n, k)) or False)
    monkeypatch.setattr(w4a8, "quantize_rows_from_parts", lambda *a: pytest.fail("the fused quantize ran"))
    unfused = w4a8_glu(x_q, x_scale, pw, None, torch.float32)
    assert launches == [(96, 256)]
    assert_same_quantized_rows(device, unfused, fused)
