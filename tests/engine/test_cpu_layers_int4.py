"""Int4Linear against an independent reference: GGUF Q4_0 / Q4_1 / Q4_K blocks dequantized by the `gguf`
package itself, multiplied in float64. The kernel rounds x, the scales and the zeros to bfloat16 and its
result to bfloat16, so every output is held to the bound those roundings allow (see `bf16_bound`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radiance.checkpoint.gguf_blocks import int4_from_blocks
from radiance.formats import INT4_GROUP, Int4Weight
from radiance.layers.int4_linear import Int4Linear

BF16_HALF_ULP = 2.0 ** -9  # relative rounding error of one bfloat16 rounding


def gguf_weight(type_name: str, rows: int, cols: int, seed: int = 0,
                magnitude: float = 1.0) -> tuple[Int4Weight, torch.Tensor]:
    """(Int4Weight read from GGUF blocks, the float64 values the gguf package dequantizes them to)."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name == "Q4_K":  # gguf cannot quantize Q4_K: random super-blocks with finite fp16 d and dmin
        n = rows * cols // 256
        blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
        for at in (0, 2):
            d = (rng.uniform(1e-3, 2e-2, n) * magnitude).astype(np.float16)
            blocks[:, at:at + 2] = d.view(np.uint8).reshape(n, 2)
        blocks = blocks.reshape(rows, -1)
    else:
        values = rng.standard_normal((rows, cols)) * rng.uniform(0.1, 2.0, (rows, 1)) * magnitude
        values[:, -INT4_GROUP:] += 3.0 * magnitude  # a group far from zero: Q4_1's min does the work
        blocks = gguf.quants.quantize(values.astype(np.float32), qtype)
    expected = np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float64).reshape(rows, cols)
    return int4_from_blocks(blocks, type_name, rows, cols), torch.from_numpy(expected)


def bf16_bound(x: torch.Tensor, weight: Int4Weight, exact: torch.Tensor) -> torch.Tensor:
    """Per-output error the kernel's roundings allow: x to bf16 (|x| |w| 2^-9), scale and zero to bf16
    (w = (c - 8) s + z: 8 |s| 2^-9 + |z| 2^-9, |z| <= |offset| + 8 |s|) and the result to bf16 (|y| 2^-9),
    doubled for the fp32 sums and the second-order terms."""
    per_group = 16 * weight.scale.double().abs() + weight.offset.double().abs()
    per_weight = per_group.repeat_interleave(INT4_GROUP, dim=1)
    w_abs = (weight.scale.double().abs() * 15 + weight.offset.double().abs()).repeat_interleave(INT4_GROUP, dim=1)
    x_abs = x.double().abs()
    return 2 * BF16_HALF_ULP * (x_abs @ (per_weight + w_abs).t() + exact.abs())


def check_against_gguf(layer: Int4Linear, weight: Int4Weight, values: torch.Tensor, x: torch.Tensor):
    out = layer(x)
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], values.shape[0])
    x64 = x.double().reshape(-1, values.shape[1])
    exact = x64 @ values.t()
    err = (out.double().reshape(exact.shape) - exact).abs()
    assert (err <= bf16_bound(x64, weight, exact)).all(), float((err / bf16_bound(x64, weight, exact)).max())
    assert err.norm() <= 1e-2 * exact.norm()


SHAPES = [("Q4_0", 16, 32), ("Q4_0", 48, 160), ("Q4_1", 16, 32), ("Q4_1", 80, 224), ("Q4_1", 48, 160),
          ("Q4_K", 16, 256), ("Q4_K", 48, 768)]  # K an odd number of groups / of Q4_K super-blocks


@pytest.mark.parametrize("type_name, n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_gguf_values_within_the_bf16_bound(type_name, n, k, m, dtype):
    weight, values = gguf_weight(type_name, n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    check_against_gguf(Int4Linear(weight), weight, values, x)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("w_mag, x_mag", [(1e-3, 1.0), (1e3, 1.0), (1.0, 1e-6), (1.0, 1e6), (1e3, 1e20)])
def test_large_and_small_magnitudes_keep_the_bound(type_name, w_mag, x_mag):
    k = 256 if type_name == "Q4_K" else 96
    weight, values = gguf_weight(type_name, 32, k, seed=7, magnitude=w_mag)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)) * x_mag
    check_against_gguf(Int4Linear(weight), weight, values, x)


def test_a_batch_of_sequences_is_the_rows_one_by_one():
    weight, values = gguf_weight("Q4_1", 48, 160, seed=3)
    layer = Int4Linear(weight)
    x = torch.randn(3, 5, 160, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    check_against_gguf(layer, weight, values, x)
    rows = torch.stack([torch.cat([layer(x[b, t:t + 1]) for t in range(5)]) for b in range(3)])
    assert torch.equal(out, rows)  # a token's output does not depend on what it is batched with
    assert torch.equal(layer(x[1, 2]), out[1, 2])  # a single vector in, a vector out


def test_zero_rows_give_zero_and_nonfinite_rows_stay_in_their_row():
    weight, _ = gguf_weight("Q4_1", 48, 160, seed=4)
    layer = Int4Linear(weight)
    for m in (2, 7, 64):
        x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
        x[0] = 0.0
        clean = layer(x)
        assert torch.equal(clean[0], torch.zeros(48))
        for bad in (float("nan"), float("inf"), float("-inf")):
            for row in {1, m // 2, m - 1}:
                poisoned = x.clone()
                poisoned[row, 17] = bad
                out = layer(poisoned)
                assert not torch.isfinite(out[row]).any()
                others = torch.arange(m) != row
                assert torch.equal(out[others], clean[others]), (m, bad, row)


def test_the_same_result_with_one_and_two_threads():
    weight, _ = gguf_weight("Q4_K", 64, 768, seed=5)
    layer = Int4Linear(weight)
    x = torch.randn(64, 768, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [layer(x[:m]) for m in (1, 7, 64)]
        torch.set_num_threads(2)
        two = [layer(x[:m]) for m in (1, 7, 64)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_an_input_of_the_wrong_width_is_refused():
    """reshape(-1, K) used to regroup a [4, 32] input of a K = 64 layer into 2 rows: a [2, 16] result."""
    weight, _ = gguf_weight("Q4_0", 16, 64)
    layer = Int4Linear(weight, name="model.layers.0.mlp.down_proj")
    for shape in [(4, 32), (2, 2, 32), (3, 96), (32,)]:
        with pytest.raises(ValueError, match="down_proj: input has .* features, the weight takes 64"):
            layer(torch.randn(*shape))


@pytest.mark.parametrize("cast", [lambda m: m.float(), lambda m: m.to(torch.float16), lambda m: m.to("cpu")])
def test_module_casts_leave_the_kernel_operands_as_packed(cast):
    """The bf16 scales were a floating buffer: model.float() made them fp32 and every call failed."""
    weight, values = gguf_weight("Q4_1", 16, 64)
    layer = Int4Linear(weight)
    x = torch.randn(3, 64)
    before = layer(x)
    cast(layer)
    assert torch.equal(layer(x), before)
    assert layer.scale_zero.dtype == torch.bfloat16
