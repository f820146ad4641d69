"""The exact W4A8 reference on the CPU against a deliberately simple one written here: the e4m3 grid and the
e2m1 / e8m0 values built from their definitions, per-token scale = max(amax / 448, 1 / (448 * 512)) (DESIGN.md),
round to nearest even, and the product in float64."""

from __future__ import annotations

import pytest
import torch

from radiance.kernels.reference import quantize_activations_reference, w4a8_reference

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_FLOOR = torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32).double()  # its fp32 value


def e4m3_grid() -> torch.Tensor:
    """Non-negative e4m3fn values in code order (code = 8 e + m; 0x7F is NaN): the index is the code."""
    subnormal = [m / 8 * 2.0 ** -6 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:-1]
    return torch.tensor(subnormal + normal, dtype=torch.float64)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value of float64 v with |v| <= 448, ties to the even code."""
    grid = e4m3_grid()
    a = v.abs()
    hi = torch.searchsorted(grid, a).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.copysign(grid[pick], v)


def simple_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float64, scale float64) as DESIGN.md states them, every fp32 step rounded where fp32 rounds it."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).double()
    scale = torch.maximum((amax / 448.0).float().double(), SCALE_FLOOR)
    scaled = (x32.double() / scale).float().double().clamp(-448.0, 448.0)
    return round_to_e4m3(scaled), scale


def simple_mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [N, K] from e2m1 nibbles (low nibble = even k, bit 3 = sign) and e8m0 bytes (2^(e - 127))."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    block = torch.pow(2.0, scale.double() - 127.0).repeat_interleave(32, dim=1)
    return table[codes] * block


def random_mxfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(115, 130, (n, k // 32), dtype=torch.uint8, generator=g)
    return packed, scale


def check_against_simple(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = w4a8_reference(x, packed, scale)
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], packed.shape[0])
    x_q, x_scale = simple_quantize(x.reshape(-1, x.shape[-1]))
    w = simple_mxfp4_values(packed, scale)
    exact = (x_q @ w.t()) * x_scale
    magnitude = (x_q.abs() @ w.abs().t()) * x_scale  # what fp32 sums lose precision against
    err = (out.reshape(exact.shape).double() - exact).abs()
    rounding = 2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -23  # the result in x's dtype
    assert (err <= rounding * exact.abs() + 1e-5 * magnitude).all()
    return out


@pytest.mark.parametrize("n, k", [(1, 32), (40, 96), (48, 160), (24, 800)])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_simple_reference(n, k, m, dtype):
    packed, scale = random_mxfp4(n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    check_against_simple(x, packed, scale)


def test_activations_quantize_bit_for_bit_like_the_definition():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(200, generator=g) * 2.0 ** e for e in (-40, -12, -9, -3, 0, 7, 60, 120)]
    x = torch.stack(rows)
    x[1, 3] = 0.75 * 2.0 ** -12  # ties between two e4m3 values appear once scaled
    x_q, x_scale = quantize_activations_reference(x)
    want_q, want_scale = simple_quantize(x)
    assert torch.equal(x_scale.double(), want_scale) and torch.equal(x_q.double(), want_q)


def test_the_scale_floor():
    """scale = max(amax / 448, 1 / (448 * 512)): the floor holds below amax = 1/512, amax / 448 from there."""
    x = torch.zeros(6, 64)
    amaxes = [0.0, 2.0 ** -20, 2.0 ** -10, 2.0 ** -9, 2.0 ** -9 * 1.01, 1.0]  # 2^-9 = 1/512: the boundary
    for row, amax in enumerate(amaxes):
        x[row] = torch.linspace(-amax, amax, 64)
    x_q, x_scale = quantize_activations_reference(x)
    floor = torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32)
    assert torch.equal(x_scale[:4, 0], floor.expand(4))
    assert torch.equal(x_scale[4:, 0], torch.tensor(amaxes[4:]) / 448.0)
    assert torch.equal(x_q[0].float(), torch.zeros(64))  # an all-zero token stays finite and zero
    assert (x_q[1:].float().abs().amax(dim=-1) <= 448).all() and torch.isfinite(x_q.float()).all()
    back = x_q[2:].double() * x_scale[2:].double()  # what the fp8 values stand for: x within e4m3's 2^-4
    assert ((back - x[2:].double()).abs() <= 2.0 ** -4 * x[2:].double().abs() + 2.0 ** -9 * x_scale[2:]).all()


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1e3, 1e30])
def test_large_and_small_magnitudes(magnitude):
    packed, scale = random_mxfp4(16, 96, seed=1)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)) * magnitude
    assert torch.isfinite(check_against_simple(x, packed, scale)).all()


def test_activations_near_the_fp32_maximum_overflow_to_inf_not_nan():
    packed, scale = random_mxfp4(16, 96, seed=1)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    x = x / x.abs().amax() * 3e38
    x_q, x_scale = quantize_activations_reference(x)
    want_q, want_scale = simple_quantize(x)
    assert torch.equal(x_scale.double(), want_scale) and torch.equal(x_q.double(), want_q)
    out = w4a8_reference(x, packed, scale)
    exact = (want_q @ simple_mxfp4_values(packed, scale).t()) * want_scale
    beyond = exact.abs() > 2 * torch.finfo(torch.float32).max  # clear of the rounding boundary
    assert beyond.any() and torch.equal(out[beyond], torch.copysign(torch.tensor(float("inf")), exact[beyond]).float())
    assert not torch.isnan(out).any()


def test_a_batch_of_sequences_is_the_flat_batch():
    packed, scale = random_mxfp4(48, 160, seed=2)
    x = torch.randn(3, 5, 160, generator=torch.Generator().manual_seed(2))
    out = check_against_simple(x, packed, scale)
    assert torch.equal(out, w4a8_reference(x.reshape(15, 160), packed, scale).reshape(3, 5, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_and_nonfinite_rows_stay_in_their_row(dtype):
    packed, scale = random_mxfp4(40, 96, seed=4)
    for m in (1, 2, 7, 64):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(dtype)
        x[0] = 0.0
        clean = w4a8_reference(x, packed, scale)
        assert torch.equal(clean[0].float(), torch.zeros(40))
        for bad in (float("nan"), float("inf"), float("-inf")):
            for row in {0, m // 2, m - 1}:
                poisoned = x.clone()
                poisoned[row, 5] = bad
                out = w4a8_reference(poisoned, packed, scale)
                assert torch.isnan(out[row]).all()
                others = torch.arange(m) != row
                assert torch.equal(out[others], clean[others]), (m, bad, row)


def test_one_and_two_threads_agree_up_to_the_fp32_sum_order():
    """The quantized activations are bit-identical; the fp32 matmul may sum in another order with two
    threads (seen at M = 64, K = 1536: one fp32 ulp), so the outputs agree to the summation bound only."""
    packed, scale = random_mxfp4(64, 1536, seed=5)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        q1, s1 = quantize_activations_reference(x)
        one = w4a8_reference(x, packed, scale)
        torch.set_num_threads(2)
        q2, s2 = quantize_activations_reference(x)
        two = w4a8_reference(x, packed, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    magnitude = (q1.double().abs() @ simple_mxfp4_values(packed, scale).abs().t()) * s1.double()
    assert ((one.double() - two.double()).abs() <= 1e-5 * magnitude).all()
