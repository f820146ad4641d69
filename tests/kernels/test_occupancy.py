"""The occupancy cap (kernels/occupancy.py): its shared-memory arithmetic and patch/restore on the CPU; on a GPU, a
decode GEMM captured into a CUDA graph under the cap gives the eager launch's bytes."""

import contextlib
import types

import pytest
import torch

import radiance.kernels.occupancy as occupancy
import radiance.kernels.w4a8 as w4a8
from radiance.kernels.activation import quantize_activations
from radiance.kernels.device_info import shared_memory_limits
from radiance.kernels.occupancy import ctas_per_sm, ctas_per_sm_at_most, shared_bytes_for_cap
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.w4a8 import w4a8_gemm
from tests.kernels.conftest import random_mxfp4

H200 = (233472, 232448)  # shared memory per SM, per-block opt-in
ADA = (102400, 101376)


@pytest.mark.parametrize("limits", [H200, ADA], ids=["sm90", "sm89"])
@pytest.mark.parametrize("own", [0, 24 * 1024, 45 * 1024])
@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5, 6])
def test_shared_bytes_fit_exactly_cap_ctas(limits, own, cap):
    shared = shared_bytes_for_cap(cap, own, *limits)
    if ctas_per_sm(own, limits[0]) <= cap:
        assert shared == own  # the kernel's own shared memory already caps it
    else:
        assert ctas_per_sm(shared, limits[0]) == cap and own < shared <= limits[1]


def test_a_cap_past_the_opt_in_limit_or_below_one_is_refused():
    assert shared_bytes_for_cap(1, 0, 233472, 100 * 1024) == 0  # one per SM would need ~114 KB: not asked for
    with pytest.raises(ValueError, match="cap of 0"):
        shared_bytes_for_cap(0, 0, *H200)


def _fake_kernel(shared):
    meta = types.SimpleNamespace(shared=shared)
    return types.SimpleNamespace(metadata=meta, packed_metadata=(4, 1, shared), function=111, name="k", kernel=b"")


@pytest.mark.parametrize("cap, swaps_function", [(4, False), (2, True)])
def test_the_launch_metadata_is_patched_inside_and_restored_after(monkeypatch, cap, swaps_function):
    monkeypatch.setattr(occupancy, "shared_memory_limits", lambda device: H200)
    monkeypatch.setattr(occupancy, "_opt_in_function", lambda compiled, device: 222)
    kernel = _fake_kernel(36 * 1024)
    with pytest.raises(RuntimeError, match="launch failed"):
        with ctas_per_sm_at_most(kernel, cap, torch.device("cuda", 0)):
            num_warps, num_ctas, shared = kernel.packed_metadata
            assert (num_warps, num_ctas) == (4, 1) and ctas_per_sm(shared, H200[0]) == cap
            assert kernel.function == (222 if swaps_function else 111)  # > 48 KB needs the opt-in function
            raise RuntimeError("launch failed")
    assert kernel.packed_metadata == (4, 1, 36 * 1024) and kernel.function == 111


def test_nothing_is_patched_without_device_limits_or_known_metadata(monkeypatch):
    kernel = _fake_kernel(36 * 1024)
    with ctas_per_sm_at_most(kernel, 1, torch.device("cpu")):  # no device limits
        assert kernel.packed_metadata == (4, 1, 36 * 1024)
    monkeypatch.setattr(occupancy, "shared_memory_limits", lambda device: H200)
    odd = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0), packed_metadata=(4, 1), function=1)
    with ctas_per_sm_at_most(odd, 1, torch.device("cuda", 0)):  # another Triton's metadata
        assert odd.packed_metadata == (4, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,m", [(28672, 4096, 1), (4096, 14336, 1), (6144, 4096, 16), (4096, 4096, 64)])
def test_capped_graph_gives_the_eager_bytes(n, k, m, monkeypatch):
    """Captured (so capped: 448 CTAs -> 4 per SM, a split 4096x14336 -> 2 per SM past 48 KB), replayed on fresh
    activations: the eager launch's bytes."""
    seen = []  # (cap, CTAs per SM the patched launch allows, launch metadata restored after)

    @contextlib.contextmanager
    def spy(compiled, cap, device):
        with ctas_per_sm_at_most(compiled, cap, device):
            allowed = ctas_per_sm(compiled.packed_metadata[2], shared_memory_limits(device)[0])
            yield
        seen.append((cap, allowed, compiled.packed_metadata[2] == compiled.metadata.shared))

    monkeypatch.setattr(w4a8, "ctas_per_sm_at_most", spy)
    pw = prepare_mxfp4(*random_mxfp4(n, k, "cuda"))
    static_x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w4a8_gemm(*quantize_activations(static_x), pw)  # compiles outside the capture
    assert seen == []  # eager launches are not capped
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = w4a8_gemm(*quantize_activations(static_x), pw)
    assert len(seen) == 1 and seen[0][1] <= seen[0][0] and seen[0][2], seen
    for _ in range(2):
        fresh = torch.randn_like(static_x)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, w4a8_gemm(*quantize_activations(fresh), pw))
