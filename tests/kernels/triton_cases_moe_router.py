"""The router GEMV (moe_routing.router_logits) against torch's linear, which it replaces at decode sizes: ragged
expert and token counts, a hidden size in two chunks with a partial one, with and without bias. Run on CUDA, or
on the CPU through the Triton interpreter by test_triton_interpreter.py."""

import pytest
import torch

from radiance.kernels import moe_routing
from radiance.kernels.reference import relative_error


@pytest.mark.parametrize("tokens,num_experts,hidden", [(1, 32, 2880), (3, 33, 64), (5, 4, 4096), (16, 128, 2048),
                                                       (2, 7, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_router_logits_match_linear(device, tokens, num_experts, hidden, bias):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = torch.randn(num_experts, hidden, device=device, dtype=dtype) / hidden ** 0.5
    b = torch.randn(num_experts, device=device, dtype=dtype) if bias else None
    got = moe_routing.router_logits(x, weight, b)
    assert got.dtype == dtype and got.shape == (tokens, num_experts)
    want = torch.nn.functional.linear(x.double(), weight.double(), b.double() if bias else None)
    # one rounding to the output dtype after fp32 sums (the same as torch's linear up to the summation order)
    assert relative_error(got.double(), want) <= (4e-3 if dtype == torch.bfloat16 else 1e-6)
    if bias:  # the case can fail: a kernel that dropped the bias is far outside the bound
        assert relative_error(torch.nn.functional.linear(x.double(), weight.double()), want) > 0.1


def test_router_logits_above_the_kernel_band_are_torchs(device):
    tokens = moe_routing.ROUTER_KERNEL_MAX_TOKENS + 1
    x = torch.randn(tokens, 64, device=device)
    weight = torch.randn(8, 64, device=device)
    assert torch.equal(moe_routing.router_logits(x, weight), torch.nn.functional.linear(x, weight))
