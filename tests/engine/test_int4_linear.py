"""Int4Linear: 4-bit GGUF linears on the CPU from their codes, and how build_linear routes them."""

from __future__ import annotations

import logging

import pytest
import torch

from radiance.config import KernelConfig, ModelConfig
from radiance.engine.linears import build_linear
from radiance.formats import INT4_GROUP, Int4Weight, dequantize
from radiance.layers.int4_linear import Int4Linear, int4_cpu_unsupported
from radiance.layers.linear import DenseLinear, Mxfp4Linear, linear_summary


def random_int4(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(rows, cols // INT4_GROUP, generator=g) * 0.02 + 1e-3
    offset = -8 * scale + 0.01 * torch.randn(rows, cols // INT4_GROUP, generator=g)
    return Int4Weight(packed, scale, offset)


def bf16_reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """What the kernel computes: x, scale and zero (= offset + 8 scale) rounded to bfloat16, fp32 sums,
    the result rounded to bfloat16."""
    scale = weight.scale.to(torch.bfloat16).float()
    zero = (weight.offset + 8 * weight.scale).to(torch.bfloat16).float()
    w = Int4Weight(weight.packed, scale, zero - 8 * scale)
    return (x.to(torch.bfloat16).float() @ dequantize(w).t()).to(torch.bfloat16).float()


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (960, 576)])
@pytest.mark.parametrize("m", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(n, k, m, dtype):
    weight = random_int4(n, k, seed=n + k + m)
    layer = Int4Linear(weight)
    x = torch.randn(m, k).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = bf16_reference(x.float(), weight)
    # up to the fp32 summation order, which can move a few outputs by one bf16 ulp
    assert (out.float() - expected).norm() <= 1e-3 * expected.norm()
    exact = x.float() @ dequantize(weight).t()
    assert (out.float() - exact).norm() <= 1e-2 * exact.norm()


def test_lead_dimensions_and_row_isolation():
    weight = random_int4(48, 64)
    layer = Int4Linear(weight)
    x = torch.randn(2, 3, 64)
    clean = layer(x)
    assert clean.shape == (2, 3, 48)
    x[0, 1, 5] = float("nan")
    poisoned = layer(x)
    assert torch.isnan(poisoned[0, 1]).all()
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = False
    assert torch.equal(poisoned[keep], clean[keep])


def test_unsupported_shapes_and_devices_say_why():
    assert int4_cpu_unsupported(random_int4(48, 64), torch.device("cpu")) is None
    assert "multiple of 16" in int4_cpu_unsupported(random_int4(40, 64), torch.device("cpu"))
    assert "CPU kernel" in int4_cpu_unsupported(random_int4(48, 64), torch.device("cuda"))


def build(weight, name="model.layers.0.mlp.down_proj", **model):
    return build_linear(name, weight, ModelConfig(**model), KernelConfig(), torch.float32)


def test_build_linear_routes_int4_weights():
    weight = random_int4(48, 64)
    values = dequantize(weight)
    module, how, _ = build(weight)
    assert isinstance(module, Int4Linear) and how == "int4"
    for options in ({"quantization": "none"}, {"ignore": ("down_proj",)}):
        module, how, _ = build(weight, **options)
        assert isinstance(module, DenseLinear) and how == "dense" and torch.equal(module.weight, values)
    module, how, _ = build_linear("x", weight, ModelConfig(), KernelConfig(cpu_int4=False), torch.float32)
    assert isinstance(module, DenseLinear) and torch.equal(module.weight, values)
    module, how, err = build(weight, quantization="mxfp4")
    assert isinstance(module, Mxfp4Linear) and how == "mxfp4" and 0 < err < 0.2
    module, how, err = build(weight, quantization="nvfp4")
    assert isinstance(module, Mxfp4Linear) and how == "mxfp4" and 0 < err < 0.2


def test_a_shape_the_kernel_refuses_is_served_dense_with_a_warning(caplog):
    weight = random_int4(40, 64)
    with caplog.at_level(logging.WARNING, logger="radiance.engine.linears"):
        module, how, _ = build(weight)
    assert isinstance(module, DenseLinear) and torch.equal(module.weight, dequantize(weight))
    assert "not on the int4 CPU kernel" in caplog.text and "multiple of 16" in caplog.text


def test_summary_counts_int4_linears():
    model = torch.nn.ModuleDict({"a": Int4Linear(random_int4(16, 32)), "b": Int4Linear(random_int4(32, 32))})
    assert linear_summary(model) == "2 4-bit GGUF linears on the int4 CPU kernel"
    model["c"] = DenseLinear(torch.zeros(8, 32))
    assert linear_summary(model) == "2 4-bit GGUF linears on the int4 CPU kernel; 1 dense 16-bit linear"
