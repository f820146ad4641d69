"""The checks of the LoRA kernels (radiance.kernels.lora) against their torch references, shared by the interpreter
cases (triton_cases_lora.py, small shapes) and the compiled GPU matrix (test_gpu_lora_kernels.py)."""

from __future__ import annotations

import torch

from radiance.kernels.lora import lora_expand_add, lora_expand_add_reference, lora_shrink, lora_shrink_reference
from radiance.kernels.reference import quantize_activations_reference

# x kinds of the shrink: (x dtype, A dtype); "e4m3" is fp8 codes with per-row scales
X_KINDS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
           "e4m3-bf16": ("e4m3", torch.bfloat16), "e4m3-fp16": ("e4m3", torch.float16),
           "fp32": (torch.float32, torch.float32)}
# (out dtype, B dtype) of the expand
OUT_KINDS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
             "fp32-out-bf16-b": (torch.float32, torch.bfloat16), "fp32": (torch.float32, torch.float32)}


def row_slots(m: int, loras: int, gen: torch.Generator, device) -> torch.Tensor:
    """[m + 3] slots: every slot and -1 among the first m rows where m allows (fewer rows: slot 0 first), in a random
    order, the rest random; the 3 rows past m hold a live slot the kernel must not read."""
    slots = torch.randint(-1, loras, (m + 3,), generator=gen)
    cycle = torch.arange(loras + 1) - 1
    first = min(m, len(cycle))
    slots[:first] = cycle.roll(-1)[:first][torch.randperm(first, generator=gen)]
    slots[m:] = loras - 1
    return slots.to(device)


def check_shrink(m: int, k: int, loras: int, slot_width: int, x_kind: str, device,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_shrink gives lora_shrink_reference's fp32 values within fp32 summation error (relative to |x| @ |A|^T),
    columns of other slots and rows without an adapter exact zeros, and the same bits when called again (its split
    sums run in a fixed order and re-arm their counters). Returns its output and the rows' slots."""
    gen = torch.Generator().manual_seed(seed)
    x_dtype, a_dtype = X_KINDS[x_kind]
    w = loras * slot_width
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]  # rows of different magnitudes
    a = torch.randn(w, k, generator=gen) / k ** 0.5
    x_scale = None
    if x_dtype == "e4m3":
        x, x_scale = quantize_activations_reference(x)
        x, x_scale = x.to(device), x_scale.to(device)
    else:
        x = x.to(device, x_dtype)
    a = a.to(device, a_dtype)
    slots = row_slots(m, loras, gen, device)
    got = lora_shrink(x, a, slots, slot_width, x_scale)
    assert got.dtype == torch.float32 and got.shape == (m, w)
    assert torch.equal(lora_shrink(x, a, slots, slot_width, x_scale), got)
    ref = lora_shrink_reference(x, a, slots, slot_width, x_scale)
    xf = x.float() * x_scale if x_scale is not None else x.float()
    bound = 2e-5 * (xf.abs() @ a.float().abs().t()) + 1e-30
    assert torch.all((got - ref).abs() <= bound), float(((got - ref).abs() / bound).max())
    kept = slots[:m, None].cpu() == torch.arange(w)[None, :] // slot_width
    assert torch.all(got.cpu()[~kept] == 0)  # other slots' columns, rows of slot -1
    assert torch.all(got.cpu()[kept] != 0)  # and the row's own columns were computed
    return got, slots


def check_expand(m: int, n: int, loras: int, slot_width: int, out_kind: str, device, seed: int = 0) -> None:
    """lora_expand_add adds each row's own slot's columns of shrunk (here nonzero in every column) times B^T into
    out with one rounding: within an ulp of the fp32 reference's rounding (a few for fp32 out; rounding_bound),
    and, 16-bit, on CUDA equal to it but for rare last-bit flips (the interpreter truncates fp32 -> bf16); rows
    without an adapter keep their bits."""
    gen = torch.Generator().manual_seed(seed)
    out_dtype, b_dtype = OUT_KINDS[out_kind]
    w = loras * slot_width
    shrunk = torch.randn(m, w, generator=gen).to(device)
    b = (torch.randn(n, w, generator=gen) / w ** 0.5).to(device, b_dtype)
    out = torch.randn(m, n, generator=gen).to(device, out_dtype)
    slots = row_slots(m, loras, gen, device)
    ref = lora_expand_add_reference(out.clone(), shrunk, b, slots, slot_width)
    got = out.clone()
    assert lora_expand_add(got, shrunk, b, slots, slot_width) is got
    own = slots[:m, None] == torch.arange(w, device=device)[None, :] // slot_width
    truncates = out_dtype == torch.bfloat16 and not got.is_cuda
    bound = rounding_bound(ref, out, shrunk * own, b, ulps=4 if out_dtype == torch.float32 else 2 if truncates else 1)
    diff = (got.float() - ref.float()).abs()
    assert torch.all(diff <= bound), float((diff / bound).max())
    no_adapter = slots[:m] < 0
    assert torch.equal(got[no_adapter], out[no_adapter])
    assert (got[~no_adapter] != out[~no_adapter]).any(dim=1).all()  # and those with one got their delta
    if out_dtype == torch.float32:
        return
    assert truncates or (got != ref).float().mean() < 0.02


def rounding_bound(ref: torch.Tensor, out: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, ulps: int):
    """How far a kernel's 16-bit out + shrunk @ b^T may lie from the reference's: `ulps` of the result (two where
    the interpreter truncates), plus, relative to the terms' magnitudes (they decide it where out and the delta
    cancel), the fp32 summation error of both and the kernel's hi + lo split of shrunk for a 16-bit B (eps^2: hi
    and lo each off by at most eps of what they hold, truncated or rounded)."""
    terms = out.float().abs() + shrunk.abs() @ b.float().abs().t()
    split = torch.finfo(b.dtype).eps ** 2 if b.dtype != torch.float32 else 0.0
    return ulps * torch.finfo(ref.dtype).eps * ref.float().abs() + (1e-6 + split) * terms + 1e-30


def check_pair(m: int, k: int, n: int, loras: int, slot_width: int, x_kind: str, device, seed: int = 0) -> None:
    """shrink then expand (16-bit out) against both references in a row."""
    gen = torch.Generator().manual_seed(seed)
    shrunk, slots = check_shrink(m, k, loras, slot_width, x_kind, device, seed)
    out_dtype = X_KINDS[x_kind][1]
    b = (torch.randn(n, loras * slot_width, generator=gen) / slot_width ** 0.5).to(device, out_dtype)
    out = torch.randn(m, n, generator=gen).to(device, out_dtype)
    ref = lora_expand_add_reference(out.clone(), shrunk, b, slots, slot_width)
    got = lora_expand_add(out.clone(), shrunk, b, slots, slot_width)
    truncates = out_dtype == torch.bfloat16 and not got.is_cuda
    assert torch.all((got.float() - ref.float()).abs() <= rounding_bound(ref, out, shrunk, b, 2 if truncates else 1))
