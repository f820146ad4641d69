"""LoraLinear: an installed linear plus the LoRA deltas of every adapter slot, for batches that mix adapters.

Each wrapped linear holds the stacked weights of all `max_loras` slots: A_all [slots * P * r_max, K] and
B_all [N, slots * P * r_max], P being its partitions (q, k, v of a qkv_proj), so B is block-diagonal and each
partition sees only its own adapter. A step's rows pick their slot's columns,

    out = base(x) + ((x @ A_all^T) * row_mask) @ B_all^T,   row_mask[t, c] = (slot of row t == slot of column c),

from the slot of each row (-1: no adapter, no columns), which LoraStepContext writes once a step into a static
device buffer. On CUDA (and under the Triton interpreter) two Triton launches add the delta (radiance.kernels.lora):
the shrink reads the slots itself and keeps each row's own columns, in fp32, and the expand adds the product into
out in place with one rounding. Elsewhere three torch ops do, with 0/1 masks the context builds from the slots
each step: the product, the mask, and one GEMM adding the delta in place (addmm). Either way: static shapes, no
host sync and no Python loop over adapters, so a CUDA graph captures it and replays read what the runner wrote
into the context's buffers.

Where the kernels serve, the wrapper exposes its base's `path`, so a W4A8 base gets the fp8 activations of the
fused norms and GLU multiply (radiance.layers.linear.takes_fp8) and the shrink reads the same e4m3 codes and row
scales; on the torch ops it exposes none, and the norms hand it 16-bit activations, which a W4A8 base quantizes
itself (cheaper than three more torch ops dequantizing them for the delta: bench/RESULTS.md, fifty-seventh
session). Where a base leaves its split-K partials to the next norm, the expand adds the delta into the first one.
A step that computes no delta (`LoraStepContext.compute` off: no row has an adapter) runs the base as it is,
fused GLU epilogue included; with deltas gate_up gives that up (the delta joins its output before the
activation). The model runner captures its decode graphs both ways and replays the base set for base-only steps.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from radiance.engine.step_graphs import StagingSets
from radiance.kernels.activation import Fp8Activations
from radiance.kernels.lora import lora_expand_add, lora_shrink
from radiance.kernels.norm import PartialSums
from radiance.kernels.triton_support import as_rows, triton_serves

LORA_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraStepContext:
    """The slot of each row of the step being run, in one static device buffer read by every LoraLinear and every
    captured graph; rows past the step's hold slot -1. `fused`: the LoraLinears add their deltas with the Triton
    kernels, which read the slots themselves; on the torch ops the context also keeps the 0/1 masks that pick each
    row's slot columns, one static buffer per mask width (computed once a step, outside any graph; rows past the
    step's all zero). `compute` is off for steps without an adapter (eager ones skip the deltas and run the bases as
    they are; the runner replays its decode graphs captured that way) and on while the graphs that compute the deltas
    are captured (they compute them whatever a replayed step's adapters)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype  # of the masks: the model's
        self.token_slots: torch.Tensor | None = None
        self.fused = False
        self.compute = False
        self._staging: StagingSets | None = None
        self._filled = 0
        self._columns: dict[int, torch.Tensor] = {}  # mask width -> the slot of each of its columns
        self.masks: dict[int, torch.Tensor] = {}  # mask width -> [max_rows, width]

    def add_width(self, max_loras: int, slot_width: int, device: torch.device) -> int:
        """Registers the mask of a linear with `slot_width` columns per slot; its width (the masks' key)."""
        width = max_loras * slot_width
        if width not in self._columns:
            self._columns[width] = torch.arange(max_loras, device=device).repeat_interleave(slot_width)
            if self.token_slots is not None and not self.fused:
                self._allocate_mask(width)
        return width

    def _allocate_mask(self, width: int) -> None:
        self.masks[width] = torch.zeros(self.max_rows, width, dtype=self.dtype, device=self.token_slots.device)

    def allocate(self, max_rows: int, device: torch.device, fused: bool | None = None) -> None:
        """The static buffers for steps of up to `max_rows` rows (the runner sizes it: its largest step or graph).
        `fused`: whether the deltas run on the Triton kernels (default: where Triton serves `device`)."""
        self.token_slots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.fused = triton_serves(self.token_slots) if fused is None else fused
        self._staging = StagingSets([((max_rows,), torch.long)], device)
        self._filled = 0
        self.masks = {}
        if not self.fused:
            for width in self._columns:
                self._allocate_mask(width)

    @property
    def max_rows(self) -> int:
        return 0 if self.token_slots is None else self.token_slots.shape[0]

    def begin_step(self, row_slots: np.ndarray) -> None:
        """Writes the step's per-row slots (one transfer, behind anything queued before it) and, on the torch ops,
        their masks, and clears the rows the previous step wrote past them, so graph padding rows take no adapter."""
        rows = len(row_slots)
        if rows > self.max_rows:
            raise RuntimeError(f"a step of {rows} rows exceeds the LoRA row buffer of {self.max_rows}")
        end = max(rows, self._filled)
        (host,) = self._staging.next()
        view = host.numpy()
        view[:rows] = row_slots
        view[rows:end] = -1
        if end:
            self.token_slots[:end].copy_(host[:end], non_blocking=True)
            if not self.fused:  # the Triton kernels read the slots themselves
                slots = self.token_slots[:end].unsqueeze(1)
                for width, columns in self._columns.items():
                    self.masks[width][:end].copy_(slots == columns)
        self._filled = rows
        self.compute = bool(rows and np.any(np.asarray(row_slots) >= 0))

    def end_step(self) -> None:
        self.compute = False

    @contextmanager
    def capturing(self):
        """Deltas on while a graph is captured: a replay computes them whatever the step's adapters."""
        self.compute = True
        try:
            yield
        finally:
            self.compute = False


class LoraLinear(nn.Module):
    """base(x) plus the deltas of the adapters in its slots, per row (module docstring)."""

    def __init__(self, base: nn.Module, partitions: tuple[int, ...], context: LoraStepContext, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, name: str = ""):
        super().__init__()
        self.base = base
        self.name = name
        self.in_features, self.out_features = base.in_features, base.out_features
        if sum(partitions) != self.out_features:
            raise ValueError(f"{name}: partitions {partitions} do not add up to {self.out_features} outputs")
        self.partitions = tuple(partitions)
        self.context = context
        self.max_rank = max_rank
        self.slot_width = len(partitions) * max_rank  # rank columns per slot
        width = max_loras * self.slot_width
        self.register_buffer("lora_a", torch.zeros(width, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(self.out_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.mask_width = context.add_width(max_loras, self.slot_width, device)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, partitions={self.partitions}, max_rank={self.max_rank}"

    @property
    def path(self) -> str | None:
        """The base's path where the delta runs on the Triton kernels, which read fp8 activations as they come, so
        a W4A8 base takes them (takes_fp8), and wherever no delta is computed; None on the torch ops: the norms
        hand it 16-bit activations."""
        return getattr(self.base, "path", None) if self.context.fused or not self.context.compute else None

    def fuses_glu(self) -> bool:
        """The delta joins gate_up's output before the activation, so only a step without deltas (a base-only
        eager step, or the graphs captured for those) keeps the base's fused GLU epilogue."""
        return not self.context.compute and getattr(self.base, "fuses_glu", lambda: False)()

    def forward_glu(self, x, activation):
        """The base's fused GEMM + GLU (only where fuses_glu says so: no delta is computed)."""
        return self.base.forward_glu(x, activation)

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        out = self.base(x)
        return self._add_delta(out, x) if self.context.compute else out

    def forward_for_norm(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor | PartialSums:
        """forward(x) for an output a residual-add norm reads next: where the base leaves its split-K partials to
        the norm (Mxfp4Linear.forward_for_norm), the Triton expand adds the delta into the first partial, in fp32,
        and the norm's sum rounds once."""
        base_for_norm = getattr(self.base, "forward_for_norm", None)
        if base_for_norm is None or (self.context.compute and not self.context.fused):
            return self.forward(x)
        out = base_for_norm(x)
        if not self.context.compute:
            return out
        if isinstance(out, PartialSums):
            self._add_delta_fused(out.parts[0, :, :out.width], x)
            return out
        return self._add_delta_fused(out, x)

    def _add_delta(self, out: torch.Tensor, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        if self.context.fused:
            return self._add_delta_fused(out, x)
        if isinstance(x, Fp8Activations):  # quantized for a W4A8 base: the delta reads the values it multiplied
            x2 = (x.x_q.float() * x.x_scale).to(x.dtype)
        else:
            x2 = x.reshape(-1, self.in_features)
        a, b = self.lora_a, self.lora_b
        if a.dtype != x2.dtype:
            a, b = a.to(x2.dtype), b.to(x2.dtype)
        mask = self.context.masks[self.mask_width][:x2.shape[0]]
        shrunk = (x2 @ a.t()).mul_(mask.to(x2.dtype))
        out2 = out.reshape(-1, self.out_features)
        if out2.dtype != shrunk.dtype:
            return out + (shrunk @ b.t()).reshape(out.shape).to(out.dtype)
        return out2.addmm_(shrunk, b.t()).reshape(out.shape)  # one GEMM adds the delta in place

    def _add_delta_fused(self, out: torch.Tensor, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """out + the delta, added in place by the two Triton launches (the shrink reads e4m3 codes as they are).
        out: the linear's output, or an fp32 [M, N] view of its first split-K partial (rows may be strided)."""
        if isinstance(x, Fp8Activations):
            x2, x_scale = x.x_q, x.x_scale
        else:
            x2, x_scale = as_rows(x.reshape(-1, self.in_features)), None
        if out.dim() == 2 and out.stride(1) == 1:
            rows = out
        else:
            out = out if out.is_contiguous() else out.contiguous()
            rows = out.view(-1, self.out_features)
        shrunk = lora_shrink(x2, self.lora_a, self.context.token_slots, self.slot_width, x_scale)
        lora_expand_add(rows, shrunk, self.lora_b, self.context.token_slots, self.slot_width)
        return out

    @torch.no_grad()
    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        """Slot `slot` takes an adapter's (A [r, K], B [N_p, r]) per partition (None: that partition, or the whole
        linear, gets no delta); its rank rows beyond r stay zero."""
        columns = slice(slot * self.slot_width, (slot + 1) * self.slot_width)
        self.lora_a[columns].zero_()
        self.lora_b[:, columns].zero_()
        if parts is None:
            return
        offset = 0
        for i, (size, part) in enumerate(zip(self.partitions, parts)):
            if part is not None:
                a, b = part
                rank = a.shape[0]
                first = slot * self.slot_width + i * self.max_rank
                self.lora_a[first:first + rank].copy_(a)
                self.lora_b[offset:offset + size, first:first + rank].copy_(b)
            offset += size


def lora_partitions(owner: nn.Module, leaf: str, linear: nn.Module) -> tuple[int, ...]:
    """The output partitions of a linear that takes adapters: q, k, v of a qkv_proj; gate, up of a gate_up_proj."""
    if leaf == "qkv_proj":  # Qwen3.5's q_proj gives each head its gate too
        cfg = owner.cfg
        q = 2 * cfg.q_size if cfg.attention_output_gate else cfg.q_size
        return (q, cfg.kv_size, cfg.kv_size)
    if leaf == "gate_up_proj":
        half = linear.out_features // 2
        return (half, half)
    return (linear.out_features,)


def install_lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                        device: torch.device) -> tuple[LoraStepContext, dict[str, LoraLinear]]:
    """Wraps every attention linear and dense-MLP linear of the model (not a sparse MLP's experts) in a LoraLinear
    sharing one LoraStepContext; returns the context and the wrappers by canonical name."""
    from radiance.models.llama import LlamaAttention, LlamaMLP

    context = LoraStepContext(dtype)
    wrapped: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LlamaAttention):
            leaves = ("qkv_proj", "o_proj")
        elif isinstance(module, LlamaMLP):
            leaves = ("gate_up_proj", "down_proj")
        else:
            continue
        for leaf in leaves:
            linear = getattr(module, leaf)
            if isinstance(linear, LoraLinear):
                raise RuntimeError(f"{name}.{leaf} already takes LoRA adapters")
            full = f"{name}.{leaf}" if name else leaf
            layer = LoraLinear(linear, lora_partitions(module, leaf, linear), context, max_loras, max_rank, dtype,
                               device, full)
            setattr(module, leaf, layer)
            wrapped[full] = layer
    return context, wrapped
