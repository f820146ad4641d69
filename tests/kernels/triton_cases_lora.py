"""The LoRA shrink / expand kernels vs their torch references, and LoraLinear on them vs its torch ops, on small
shapes (run on CUDA, or on the CPU through the Triton interpreter by test_triton_interpreter.py; the full matrix
runs compiled in test_gpu_lora_kernels.py)."""

import numpy as np
import pytest
import torch

from radiance.kernels.activation import Fp8Activations
from radiance.kernels.reference import quantize_activations_reference
from radiance.layers.linear import takes_fp8
from tests.kernels.lora_kernel_checks import check_expand, check_pair, check_shrink

M_BANDS = [1, 5, 16, 17, 64, 65, 257]  # decode tiles (16 rows, split K) up to 64, prefill tiles (64 rows) above
# (max_loras, slot_width): 1 x 16, 2 x (3 partitions x rank 8), 4 x (2 partitions x rank 16)
LAYOUTS = [(1, 16), (2, 24), (4, 32)]


@pytest.mark.parametrize("m", M_BANDS)
@pytest.mark.parametrize("x_kind", ["bf16", "e4m3-bf16", "e4m3-fp16", "fp32"])
def test_shrink_matches_reference(device, m, x_kind):
    i = M_BANDS.index(m)
    loras, slot_width = LAYOUTS[i % 3]
    check_shrink(m, (200, 256, 330)[i % 3], loras, slot_width, x_kind, device, seed=i)


@pytest.mark.parametrize("m", M_BANDS)
@pytest.mark.parametrize("out_kind", ["bf16", "fp16", "fp32-out-bf16-b", "fp32"])
def test_expand_add_matches_reference(device, m, out_kind):
    i = M_BANDS.index(m)
    loras, slot_width = LAYOUTS[i % 3]
    # N 70 and 200: not multiples of the 64 / 128 column tiles
    check_expand(m, (70, 96, 200)[i % 3], loras, slot_width, out_kind, device, seed=i)


@pytest.mark.parametrize("x_kind", ["bf16", "e4m3-fp16"])
def test_shrink_then_expand(device, x_kind):
    check_pair(17, 160, 72, 2, 24, x_kind, device, seed=3)


@pytest.fixture(scope="module")
def lora_pair():
    """Two LoraLinears over one MXFP4 base with the same adapters in slots 0 and 2: one on the Triton kernels, one on
    the torch ops (their contexts' `fused`), both fp32."""
    from radiance.config import KernelConfig
    from radiance.formats import DenseWeight
    from radiance.layers.linear import Mxfp4Linear
    from radiance.lora import LoraLinear, LoraStepContext

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    base, _ = Mxfp4Linear.from_weight(DenseWeight(torch.randn(96, 128, generator=gen).to(device)),
                                      kernel_config=KernelConfig())
    slots = {0: [(torch.randn(3, 128, generator=gen), torch.randn(64, 3, generator=gen)), None],
             2: [(torch.randn(4, 128, generator=gen), torch.randn(64, 4, generator=gen)),
                 (torch.randn(2, 128, generator=gen), torch.randn(32, 2, generator=gen))]}
    layers = {}
    for fused in (True, False):
        context = LoraStepContext(torch.float32)
        layer = LoraLinear(base, (64, 32), context, max_loras=3, max_rank=4, dtype=torch.float32, device=device)
        context.allocate(16, device, fused=fused)
        for slot, parts in slots.items():
            layer.set_slot(slot, [None if p is None else (p[0].to(device), p[1].to(device)) for p in parts])
        layers[fused] = layer
    return base, layers, device


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-in", "fp8-in"])
def test_lora_linear_on_the_kernels_matches_its_torch_ops(lora_pair, fp8):
    """The same step through the Triton kernels and through the torch ops (masks, addmm): the same outputs, rows
    without an adapter the base's exactly; fp8 activations read as the codes and scales the base multiplied."""
    base, layers, device = lora_pair
    fused, torch_ops = layers[True], layers[False]
    assert fused.context.fused and not torch_ops.context.fused and not fused.context.masks
    torch_ops.context.begin_step(np.array([0]))  # in a step with an adapter, the torch ops take 16-bit activations
    assert fused.path == getattr(base, "path", None) and torch_ops.path is None
    assert takes_fp8(fused) == takes_fp8(base) and not takes_fp8(torch_ops)
    torch_ops.context.end_step()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 128, generator=gen).to(device)
    if fp8:
        x = Fp8Activations(*[t.to(device) for t in quantize_activations_reference(x.reshape(12, 128).cpu())],
                           torch.float32, (2, 6))
    row_slots = np.array([2, -1, 0, 2, 1, 0, -1, 2, 2, 0, 1, -1])  # slot 1 is empty
    outs = []
    for layer in (fused, torch_ops):
        layer.context.begin_step(row_slots)
        outs.append(layer(x))
        layer.context.end_step()
    got, want = outs
    plain = base(x)
    assert got.shape == want.shape == (2, 6, 96)
    delta = (want - plain).reshape(12, 96)
    with_adapter = torch.from_numpy((row_slots == 0) | (row_slots == 2))
    assert delta[with_adapter].abs().amax(dim=1).gt(0).all()  # the deltas are there
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(delta.abs().max()))
    no_adapter = ~with_adapter  # -1 and the empty slot 1
    assert torch.equal(got.reshape(12, 96)[no_adapter], plain.reshape(12, 96)[no_adapter])
    assert torch.equal(fused(x), plain)  # outside a step: the base alone


def test_shrink_rejects_bad_arguments(device):
    from radiance.kernels.lora import lora_shrink
    x = torch.randn(3, 64, device=device)
    a = torch.randn(32, 64, device=device)
    slots = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="whole slots"):
        lora_shrink(x, a, slots, 24)
    with pytest.raises(ValueError, match="token_slots"):
        lora_shrink(x, a, slots[:2], 16)
    with pytest.raises(ValueError, match="x_scale"):
        lora_shrink(x.to(torch.float8_e4m3fn), a, slots, 16)


def test_no_rows(device):
    from radiance.kernels.lora import lora_expand_add, lora_shrink
    shrunk = lora_shrink(torch.empty(0, 64, device=device), torch.randn(32, 64, device=device),
                        torch.zeros(4, dtype=torch.long, device=device), 16)
    assert shrunk.shape == (0, 32)
    out = torch.empty(0, 48, device=device)
    assert lora_expand_add(out, shrunk, torch.randn(48, 32, device=device), torch.zeros(4, dtype=torch.long,
                                                                                       device=device), 16) is out


class PartialSumsBase(torch.nn.Module):
    """A linear that leaves its output to the next norm as three fp32 split-K partials (as the W4A8 decode GEMM's
    forward_for_norm does: rows wider than N) and has a fused GLU path of its own."""

    path = None

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.glu_calls = 0

    def forward(self, x):
        return x @ self.weight.t()

    def forward_for_norm(self, x):
        from radiance.kernels.norm import PartialSums
        full = self.forward(x.reshape(-1, self.in_features))
        parts = torch.zeros(3, full.shape[0], self.out_features + 8, device=full.device)
        for i, share in enumerate((0.5, 0.25, 0.25)):  # powers of two: the partials sum to full exactly
            parts[i, :, :self.out_features] = full * share
        return PartialSums(parts, self.out_features, torch.float32, tuple(x.shape[:-1]))

    def fuses_glu(self):
        return True

    def forward_glu(self, x, activation):
        self.glu_calls += 1
        return self.forward(x)


def test_a_delta_joins_the_first_partial_sum_and_base_only_steps_keep_the_base_paths(device):
    """Where the base leaves split-K partials to the norm, the kernels add the delta into the first one (the sum is
    base + delta; rows without an adapter sum to the base exactly); the torch ops return the summed output instead. A
    step without adapters gets the base's partials and fused GLU untouched; one with adapters never the fused GLU."""
    from radiance.kernels.norm import PartialSums
    from radiance.lora import LoraLinear, LoraStepContext

    gen = torch.Generator().manual_seed(4)
    base = PartialSumsBase(torch.randn(96, 128, generator=gen).to(device))
    parts = [(torch.randn(4, 128, generator=gen).to(device), torch.randn(64, 4, generator=gen).to(device)),
             (torch.randn(3, 128, generator=gen).to(device), torch.randn(32, 3, generator=gen).to(device))]
    layers = {}
    for fused in (True, False):
        context = LoraStepContext(torch.float32)
        layers[fused] = LoraLinear(base, (64, 32), context, max_loras=2, max_rank=4, dtype=torch.float32,
                                   device=device)
        context.allocate(8, device, fused=fused)
        layers[fused].set_slot(1, parts)
    x = torch.randn(5, 128, generator=gen).to(device)
    plain = base(x)
    row_slots = np.array([1, -1, 1, 0, -1])
    with_adapter = torch.from_numpy(row_slots == 1)
    delta = torch.cat([x @ a.t() @ b.t() for a, b in parts], dim=-1)
    for fused, layer in layers.items():
        assert layer.fuses_glu() and layer.forward_glu(x, None) is not None  # no adapter in the step: the base's
        untouched = layer.forward_for_norm(x)
        assert isinstance(untouched, PartialSums) and torch.equal(untouched.total(), plain)
        layer.context.begin_step(row_slots)
        assert not layer.fuses_glu()
        out = layer.forward_for_norm(x)
        layer.context.end_step()
        assert isinstance(out, PartialSums) == fused
        total = out.total() if fused else out
        assert torch.allclose(total[with_adapter], plain[with_adapter] + delta[with_adapter], rtol=1e-5,
                              atol=1e-5 * float(delta.abs().max()))
        assert torch.equal(total[~with_adapter], plain[~with_adapter])
    assert base.glu_calls == 2


@pytest.mark.parametrize("used", [(1,), (0, 2)], ids=["slot-1", "slots-0-2"])
@pytest.mark.parametrize("m", [1, 17, 70])
def test_the_weights_of_slots_no_row_uses_are_not_read(device, m, used):
    """A step's rows on some of 3 slots (and none): the other slots' A and B hold NaN, which a read would carry into
    the output (0 * NaN); the kernels skip them (the expand walks from the lowest used slot to the highest, slot 1
    lying between 0 and 2), so the delta is the used slots' alone."""
    from radiance.kernels.lora import (lora_expand_add, lora_expand_add_reference, lora_shrink,
                                       lora_shrink_reference)

    gen = torch.Generator().manual_seed(m)
    k, n, width = 160, 96, 16
    a = torch.randn(3 * width, k, generator=gen) / k ** 0.5
    b = torch.randn(n, 3 * width, generator=gen) / width ** 0.5
    poisoned_a, poisoned_b = torch.full_like(a, float("nan")), torch.full_like(b, float("nan"))
    for slot in used:
        columns = slice(slot * width, (slot + 1) * width)
        poisoned_a[columns], poisoned_b[:, columns] = a[columns], b[:, columns]
    x = torch.randn(m, k, generator=gen)
    rows = torch.arange(m + 2)
    slots = torch.where(rows % 3 == 0, -1, torch.tensor(used)[rows % len(used)])
    out = torch.randn(m, n, generator=gen)
    got = lora_expand_add(out.clone().to(device), lora_shrink(x.to(device), poisoned_a.to(device), slots.to(device),
                                                             width), poisoned_b.to(device), slots.to(device), width)
    want = lora_expand_add_reference(out.clone(), lora_shrink_reference(x, a, slots, width), b, slots, width)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_expand_rejects_bad_arguments(device):
    from radiance.kernels.lora import lora_expand_add
    out = torch.zeros(3, 48, device=device)
    shrunk = torch.zeros(3, 32, device=device)
    b = torch.zeros(48, 32, device=device)
    slots = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="whole slots"):
        lora_expand_add(out, shrunk, b, slots, 24)
    with pytest.raises(ValueError, match="token_slots"):
        lora_expand_add(out, shrunk, b, slots[:2], 16)
    with pytest.raises(ValueError, match=r"fp32 \[3, 32\]"):
        lora_expand_add(out, shrunk[None], b, slots, 16)
