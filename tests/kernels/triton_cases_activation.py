"""Activation-quantization kernels vs the torch reference. Run on CUDA, or on the CPU through the
Triton interpreter by test_triton_interpreter.py (not collected directly: TRITON_INTERPRET must be
set before Triton is imported)."""

import pytest
import torch
import torch.nn.functional as F

from radiance.kernels.activation import Fp8Activations, quantize_activations, quantize_rows_from_parts
from radiance.kernels.glu import GluActivation, glu_mul, glu_reference, silu_mul
from radiance.kernels.norm import add_rmsnorm, rmsnorm_quant
from radiance.kernels.reference import quantize_activations_reference, rms_normalize_reference, rmsnorm_quant_reference


@pytest.mark.parametrize("many_rows", [False, True], ids=["decode-launch", "prefill-launch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 200, 576, 5000])  # 5000: the two-pass kernel (8192 would waste 39%)
def test_triton_quant_matches_reference_bytes(device, dtype, k, many_rows, monkeypatch):
    """Both launch shapes (fewer warps and, two-pass, smaller chunks from triton_support.MANY_ROWS rows on),
    lowered to 7 rows here, give the reference's bytes."""
    from radiance.kernels import triton_support
    if many_rows:
        monkeypatch.setattr(triton_support, "MANY_ROWS", 7)
    x = (torch.randn(7, k, device=device) * torch.logspace(-3, 3, 7, device=device)[:, None]).to(dtype)
    x[3] = 0  # an all-zero token
    x_q, x_scale = quantize_activations(x)
    r_q, r_scale = quantize_activations_reference(x)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (7, k) and x_scale.shape == (7, 1)
    assert torch.equal(x_scale, r_scale)
    assert torch.equal(x_q.view(torch.uint8), r_q.view(torch.uint8))


def test_quant_accepts_leading_dims_and_strides(device):
    x = torch.randn(2, 3, 4, 64, device=device)[:, :, 1]  # non-contiguous rows
    x_q, x_scale = quantize_activations(x)
    r_q, r_scale = quantize_activations_reference(x.reshape(-1, 64))
    assert torch.equal(x_q.view(torch.uint8), r_q.view(torch.uint8)) and torch.equal(x_scale, r_scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("k", [96, 4500])
def test_nonfinite_token_does_not_touch_others(device, bad, k):
    x = torch.randn(5, k, device=device)
    clean_q, clean_s = quantize_activations(x)
    x[2, 17] = bad
    x_q, x_s = quantize_activations(x)
    others = [0, 1, 3, 4]
    assert torch.equal(x_q[others].view(torch.uint8), clean_q[others].view(torch.uint8))
    assert torch.equal(x_s[others], clean_s[others])
    # the bad token itself must not come out looking finite
    assert not torch.isfinite(x_q[2].float() * x_s[2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_quant_matches_unfused(device, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter rounds fp32 -> bf16 by truncation; checked on the GPU")
    k = 320
    x = (torch.randn(9, k, device=device) * 5).to(dtype)
    weight = (torch.rand(k, device=device) + 0.5).to(dtype)
    x_q, x_scale = rmsnorm_quant(x, weight, 1e-6)
    r_q, r_scale = rmsnorm_quant_reference(x, weight, 1e-6)
    # the kernel's rsqrt may differ from torch's in the last bit: allow rare one-step fp8 differences
    assert torch.allclose(x_scale, r_scale, rtol=1e-5, atol=0)
    diff = (x_q.float() * x_scale - r_q.float() * r_scale).abs()
    step = r_q.float().abs().clamp(min=1) * r_scale / 8  # one e4m3 step
    assert torch.all(diff <= step * 1.01)
    assert (x_q.view(torch.uint8) != r_q.view(torch.uint8)).float().mean() < 0.01
    # and the reference is what the model's RMSNorm followed by quantization computes
    n = rms_normalize_reference(x, weight, 1e-6)
    assert torch.equal(quantize_activations_reference(n)[0].view(torch.uint8), r_q.view(torch.uint8))


def test_rmsnorm_quant_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match="hidden size"):
        rmsnorm_quant(torch.randn(2, 64, device=device), torch.ones(32, device=device), 1e-6)


def _bf16_on_cpu(device, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter rounds fp32 -> bf16 by truncation; checked on the GPU")


def _close_up_to_rare_last_bit(out, ref):
    """fp32: within a few ulp (the kernel's rsqrt / exp vs torch's); 16-bit: equal except for rare
    one-ulp rounding flips."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=4e-6, atol=1e-30)
        return
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs()
    diff = (out.float() - ref.float()).abs()
    assert torch.all(diff <= ulp), float((diff / ulp.clamp(min=1e-30)).max())
    assert (out != ref).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_the_model_norm(device, dtype, with_residual):
    _bf16_on_cpu(device, dtype)
    k = 576
    x = (torch.randn(2, 5, k, device=device) * 3).to(dtype)  # leading dims are kept
    res = (torch.randn(2, 5, k, device=device) * 3).to(dtype) if with_residual else None
    weight = (torch.rand(k, device=device) + 0.5).to(dtype)
    y, s = add_rmsnorm(x, res, weight, 1e-5)
    s_ref = x + res if with_residual else x
    assert torch.equal(s, s_ref)
    _close_up_to_rare_last_bit(y, rms_normalize_reference(s_ref, weight, 1e-5))
    # quantized for a W4A8 linear: what quantizing the norm's output gives
    act, s2 = add_rmsnorm(x, res, weight, 1e-5, quantize=True)
    assert isinstance(act, Fp8Activations) and act.lead == (2, 5) and act.dtype == dtype
    assert torch.equal(s2, s_ref) and act.x_q.shape == (10, k)
    r_q, r_s = rmsnorm_quant_reference(s_ref.reshape(10, k), weight, 1e-5)
    assert torch.allclose(act.x_scale, r_s, rtol=1e-5, atol=0)
    assert (act.x_q.view(torch.uint8) != r_q.view(torch.uint8)).float().mean() < 0.01
    assert act.values is None
    # both (a sparse MLP's router reads the 16-bit norm): in bf16, as served, the bytes of each call alone
    # (fp32's last bits may move with the compiled variant's FMA contraction, as against the reference)
    both, s3 = add_rmsnorm(x, res, weight, 1e-5, quantize=True, keep_values=True)
    assert torch.equal(s3, s_ref) and both.values.shape == x.shape
    if dtype == torch.bfloat16:
        assert torch.equal(both.values, y) and torch.equal(both.x_scale, act.x_scale)
        assert torch.equal(both.x_q.view(torch.uint8), act.x_q.view(torch.uint8))
    else:
        _close_up_to_rare_last_bit(both.values, y)
        assert torch.allclose(both.x_scale, act.x_scale, rtol=1e-6, atol=0)
        assert (both.x_q.view(torch.uint8) != act.x_q.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(device, dtype):
    _bf16_on_cpu(device, dtype)
    inter = 352
    gate_up = (torch.randn(7, 2 * inter, device=device) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    _close_up_to_rare_last_bit(silu_mul(gate_up), ref)
    act = silu_mul(gate_up, quantize=True)
    r_q, r_s = quantize_activations_reference(ref)
    assert act.lead == (7,) and torch.allclose(act.x_scale, r_s, rtol=1e-5, atol=0)
    assert (act.x_q.view(torch.uint8) != r_q.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [7, 1])  # on CUDA one row of 2880 is spread over programs (the chunked kernel)
def test_glu_mul_swiglu_oai_matches_torch(device, dtype, rows):
    """gpt-oss's clamped SwiGLU in the GLU launch: glu_reference's values (clamps biting: std 6 against the
    limit 7), and its quantized rows; a kernel that ignored ACT (silu) is far off."""
    _bf16_on_cpu(device, dtype)
    act = GluActivation("swiglu_oai")
    inter = 2880
    gate_up = (torch.randn(rows, 2 * inter, device=device) * 6).to(dtype)
    ref = glu_reference(gate_up, act)
    got = glu_mul(gate_up, act)
    _close_up_to_rare_last_bit(got, ref)
    assert not torch.allclose(got.float(), silu_mul(gate_up).float(), rtol=0.1)
    q = glu_mul(gate_up, act, quantize=True)
    r_q, r_s = quantize_activations_reference(ref)
    assert q.lead == (rows,) and torch.allclose(q.x_scale, r_s, rtol=1e-5, atol=0)
    assert (q.x_q.view(torch.uint8) != r_q.view(torch.uint8)).float().mean() < 0.01


def _close_geglu(out, ref, gate_up):
    """GeGLU: within an ulp of torch's (a few in fp32), and, where 1 + tanh cancels, an ulp of 1 times the gate
    (times up); 16-bit outputs equal but for rare flips."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    gate, up = gate_up.float().chunk(2, dim=-1)
    ulps = 4 if ref.dtype == torch.float32 else 1
    slack = ulps * torch.finfo(ref.dtype).eps * ref.float().abs() + 2 ** -23 * (gate * up).abs()
    assert torch.all((out.float() - ref.float()).abs() <= slack * 1.01)
    if ref.dtype != torch.float32:
        assert (out != ref).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 1])  # on CUDA one row of 2880 is spread over programs (the chunked kernel)
def test_glu_mul_gelu_tanh_matches_torch(device, dtype, rows):
    """Gemma's GeGLU in the GLU launch: torch's gelu(approximate="tanh") * up within an ulp (and, where 1 + tanh
    cancels, an ulp of 1 times the gate), and its quantized rows; a kernel that ignored ACT (silu) is far off."""
    _bf16_on_cpu(device, dtype)
    act = GluActivation("gelu_tanh")
    inter = 2880
    gate_up = (torch.randn(rows, 2 * inter, device=device) * 2).to(dtype)
    ref = glu_reference(gate_up, act)
    got = glu_mul(gate_up, act)
    _close_geglu(got, ref, gate_up)
    assert not torch.allclose(got.float(), silu_mul(gate_up).float(), rtol=0.1)
    q = glu_mul(gate_up, act, quantize=True)
    r_q, r_s = quantize_activations_reference(ref)
    assert q.lead == (rows,) and torch.allclose(q.x_scale, r_s, rtol=1e-5, atol=0)
    assert (q.x_q.view(torch.uint8) != r_q.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("kind", ["silu", "swiglu_oai", "gelu_tanh"])
@pytest.mark.parametrize("rows", [6, 1])  # on CUDA one row of 2880 is spread over programs (the chunked kernel)
def test_glu_mul_adds_each_rows_expert_bias(device, kind, rows):
    """Expert-sorted rows: row r's gate and up get bias[row_expert[r]] before the activation, as adding the
    gathered [M, 2I] bias in torch would; a kernel that ignored the bias, or took another row's, is far off."""
    act = GluActivation(kind)
    inter, experts = 2880, 4
    gate_up = torch.randn(rows, 2 * inter, device=device) * 3
    bias = torch.randn(experts, 2 * inter, device=device) * 3
    row_expert = torch.randint(0, experts, (rows,), device=device)
    ref = glu_reference(gate_up + bias[row_expert], act)
    got = glu_mul(gate_up, act, bias=bias, row_expert=row_expert)
    if kind == "gelu_tanh":
        _close_geglu(got, ref, gate_up + bias[row_expert])
    else:
        _close_up_to_rare_last_bit(got, ref)
    assert not torch.allclose(got, glu_reference(gate_up, act), rtol=0.1)
    q = glu_mul(gate_up, act, quantize=True, bias=bias, row_expert=row_expert.to(torch.int32))
    r_q, r_s = quantize_activations_reference(ref)
    assert torch.allclose(q.x_scale, r_s, rtol=1e-5, atol=0)
    # codes compared as values: GeGLU's vanishing outputs may keep another sign of zero than torch's
    assert (q.x_q.float() != r_q.float()).float().mean() < 0.01
    with pytest.raises(ValueError, match="together"):
        glu_mul(gate_up, act, bias=bias)


def test_fused_norm_keeps_a_nan_token_to_itself(device):
    x = torch.randn(4, 128, device=device)
    res = torch.randn(4, 128, device=device)
    clean, _ = add_rmsnorm(x, res, torch.ones(128, device=device), 1e-6, quantize=True)
    x[1, 5] = float("nan")
    act, _ = add_rmsnorm(x, res, torch.ones(128, device=device), 1e-6, quantize=True)
    others = [0, 2, 3]
    assert torch.equal(act.x_q[others].view(torch.uint8), clean.x_q[others].view(torch.uint8))
    assert not torch.isfinite(act.x_scale[1]).all()


@pytest.mark.parametrize("k", [200, 2500])  # one chunk; three, the last ragged
def test_quantize_from_amax_parts_matches_quantize_activations(device, k):
    """quantize_rows_from_parts takes each row's amax from int32 |y| maxima of column slices (as the
    GLU GEMM leaves them) and must give quantize_activations' bytes, a NaN row kept to itself."""
    y = (torch.randn(6, k, device=device) * torch.logspace(-2, 2, 6, device=device)[:, None]).to(torch.bfloat16)
    y[3] = 0
    y[4, 11] = float("nan")
    y[5, -1] = float("inf")
    slices = 7
    width = -(-k // slices)
    parts = torch.stack([y[:, i:i + width].float().abs().view(torch.int32).amax(dim=1)
                         for i in range(0, k, width)], dim=1).contiguous()
    x_q, x_scale = quantize_rows_from_parts(y, parts)
    r_q, r_scale = quantize_activations(y)
    assert torch.equal(x_scale[:4], r_scale[:4]) and torch.isnan(x_scale[4]).all() and torch.isinf(x_scale[5]).all()
    assert torch.equal(x_q[:4].view(torch.uint8), r_q[:4].view(torch.uint8))
    assert not torch.isfinite(x_q[4].float() * x_scale[4]).all()
