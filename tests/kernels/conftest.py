"""Shared helpers of the kernel tests. The Triton kernels run on CUDA when there is a GPU; in CI they
run through the Triton interpreter in a subprocess (test_triton_interpreter.py), because Triton
reads TRITON_INTERPRET when it is first imported."""

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_mxfp4(n: int, k: int, device, spread: int = 5, seed: int | None = None):
    """Random MXFP4 weight: random code bytes, block exponents in [-8, spread - 8]."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.randint(119, 120 + spread, (n, k // 32), dtype=torch.uint8, device=device, generator=gen)
    return packed, scale
