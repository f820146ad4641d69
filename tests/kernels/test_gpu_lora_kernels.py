"""The LoRA kernels compiled on the GPU (run with -m gpu): shrink and expand against their torch references over the
decode and prefill M bands, the 8B's K and N (and ragged ones), slot layouts and input dtypes, and the pair captured
in a CUDA graph replaying new slots and activations. The interpreter runs the small shapes on the CPU
(triton_cases_lora.py)."""

import pytest
import torch

from radiance.kernels.lora import lora_expand_add, lora_shrink, lora_shrink_reference
from radiance.kernels.reference import quantize_activations_reference
from tests.kernels.lora_kernel_checks import check_expand, check_shrink, rounding_bound

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
M_BANDS = [1, 5, 16, 17, 64, 65, 257, 2048]
LAYOUTS = [(1, 16), (2, 24), (4, 32)]  # (max_loras, slot_width): 1 x 16, 2 x 3 x 8, 4 x 2 x 16


@pytest.mark.parametrize("m", M_BANDS)
@pytest.mark.parametrize("k", [4096, 14336, 200])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
@pytest.mark.parametrize("x_kind", ["bf16", "e4m3-bf16", "e4m3-fp16", "fp32"])
def test_shrink_matches_reference(m, k, layout, x_kind):
    check_shrink(m, k, *layout, x_kind, CUDA, seed=m + k)


def test_shrink_at_a_long_prefill():
    check_shrink(8192, 4096, 2, 24, "e4m3-bf16", CUDA, seed=1)


@pytest.mark.parametrize("m", M_BANDS)
@pytest.mark.parametrize("n", [6144, 4096, 28672, 70])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
@pytest.mark.parametrize("out_kind", ["bf16", "fp16", "fp32-out-bf16-b", "fp32"])
def test_expand_add_matches_reference(m, n, layout, out_kind):
    check_expand(m, n, *layout, out_kind, CUDA, seed=m + n)


def test_expand_at_a_long_prefill():
    check_expand(8192, 28672, 2, 24, "bf16", CUDA, seed=1)


@pytest.mark.parametrize("m", [1, 16, 100])
def test_the_pair_replays_in_a_cuda_graph(m):
    """Captured once, replays read the slots and fp8 activations written into the static buffers since: each
    replay's output is the references' for what the buffers held then (no host sync, no shape from the data)."""
    gen = torch.Generator().manual_seed(m)
    k, n, loras, width = 4096, 6144, 2, 48
    a = (torch.randn(loras * width, k, generator=gen) / k ** 0.5).to(CUDA, torch.bfloat16)
    b = (torch.randn(n, loras * width, generator=gen) / width ** 0.5).to(CUDA, torch.bfloat16)
    x_q, x_scale = (t.to(CUDA) for t in quantize_activations_reference(torch.randn(m, k, generator=gen)))
    slots = torch.full((128,), -1, dtype=torch.long, device=CUDA)
    base = torch.randn(m, n, generator=gen).to(CUDA, torch.bfloat16)
    out = base.clone()
    lora_expand_add(out, lora_shrink(x_q, a, slots, width, x_scale), b, slots, width)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        lora_expand_add(out, lora_shrink(x_q, a, slots, width, x_scale), b, slots, width)
    for step in range(3):
        new_q, new_scale = quantize_activations_reference(torch.randn(m, k, generator=gen))
        x_q.copy_(new_q.to(CUDA))
        x_scale.copy_(new_scale.to(CUDA))
        slots[:m].copy_(torch.randint(-1, loras, (m,), generator=gen))
        graph.replay()
        shrunk = lora_shrink_reference(x_q, a, slots, width, x_scale)
        ref = (base.float() + shrunk @ b.float().t()).to(torch.bfloat16)
        assert torch.all((out.float() - ref.float()).abs() <= rounding_bound(ref, base, shrunk, b, 1)), step
        assert torch.equal(out[slots[:m] < 0], base[slots[:m] < 0])
