"""How each weight format is laid out as named tensors in a checkpoint, in both directions.

compressed-tensors: nvfp4 `weight_packed` u8 [N,K/2] + `weight_scale` e4m3 [N,K/16] + `weight_global_scale`
f32 [1]; mxfp4 `weight_packed` + `weight_scale` u8 e8m0 [N,K/32]; fp8 `weight` e4m3 [N,K] + `weight_scale`
f32 [N,1], or per 128 x 128 block [ceil(N/128), ceil(K/128)] (compressed-tensors' strategy block; transformers'
`fp8` quant_method names it `weight_scale_inv`, a multiplier all the same). Quark OCP MX fp4 keeps the packed codes
under `weight` (u8) with a u8 e8m0 `weight_scale`.
ModelOpt nvfp4 keeps them under `weight` (u8) with an e4m3 `weight_scale` and `weight_scale_2`, the
reciprocal of compressed-tensors' global scale (W = e2m1 * weight_scale * weight_scale_2).
Reading validates dtype and shape of every tensor and raises CheckpointError naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radiance.checkpoint.quant_config import QuantScheme
from radiance.errors import CheckpointError
from radiance.formats import MX_BLOCK, NV_BLOCK, DenseWeight, Fp8Weight, Mxfp4Weight, Nvfp4Weight

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E8M0_DTYPES = (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()


class TensorSource(Protocol):
    meta: dict  # name -> object with .shape, .dtype, .file

    def get(self, name: str) -> torch.Tensor: ...


def detect_format(module: str, src: TensorSource) -> str | None:
    """The format a module's tensors are stored in, from names and dtypes alone (None: no weight)."""
    meta = src.meta
    if f"{module}.weight_packed" in meta:
        scale = meta.get(f"{module}.weight_scale")
        if f"{module}.weight_global_scale" in meta or (scale is not None and scale.dtype == torch.float8_e4m3fn):
            return "nvfp4"
        return "mxfp4"
    weight = meta.get(f"{module}.weight")
    if weight is None:
        return None
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    scale = meta.get(f"{module}.weight_scale")
    if weight.dtype == torch.uint8 and scale is not None:
        # ModelOpt NVFP4 (e4m3 block scales) or Quark's OCP MX layout (e8m0)
        return "nvfp4" if scale.dtype == torch.float8_e4m3fn else "mxfp4"
    return "dense"


def required_tensors(module: str, fmt: str, layout: str = "compressed-tensors") -> list[str]:
    if fmt == "nvfp4" and layout == "modelopt":
        return [f"{module}.{t}" for t in ("weight", "weight_scale", "weight_scale_2")]
    if fmt == "nvfp4":
        return [f"{module}.{t}" for t in ("weight_packed", "weight_scale", "weight_global_scale")]
    if fmt == "mxfp4":
        main = "weight" if layout == "quark" else "weight_packed"
        return [f"{module}.{main}", f"{module}.weight_scale"]
    if fmt == "fp8":
        return [f"{module}.weight", f"{module}.weight_scale_inv" if layout == "hf-fp8" else f"{module}.weight_scale"]
    return [f"{module}.weight"]


def fp8_scale_name(module: str, src: TensorSource) -> str:
    """transformers' `fp8` checkpoints store their block scales as `weight_scale_inv`, the others `weight_scale`."""
    inverse = f"{module}.weight_scale_inv"
    return inverse if inverse in src.meta else f"{module}.weight_scale"


def fp8_block_of(scale_shape, n: int, k: int) -> tuple[int, int] | None:
    """(rows, K) per scale of a block-scaled FP8 weight [N, K] from its scale's shape; None for per-channel or
    per-tensor scales. Blocks are powers of two (128 x 128 in every published checkpoint), the last ones cut short."""
    shape = tuple(scale_shape)
    if len(shape) != 2 or (shape[1] == 1 and shape[0] in (1, n)):
        return None

    def block(size: int, count: int) -> int | None:
        if count < 1:
            return None
        b = 1 << (-(-size // count) - 1).bit_length()  # the power of two at or above size / count
        return b if -(-size // b) == count else None

    rows, cols = block(n, shape[0]), block(k, shape[1])
    return (rows, cols) if rows and cols else None


def _file_of(src: TensorSource, name: str) -> str | None:
    meta = src.meta.get(name)
    return getattr(meta, "file", None)


@dataclass(frozen=True)
class _Slot:
    """One tensor a format needs: its name, allowed dtypes, exact shape (None: any) and role."""

    name: str
    dtypes: tuple
    shape: tuple | None
    what: str
    numel: tuple[int, ...] | None = None  # allowed element counts when the shape is free
    block: tuple[int, int] | None = None  # fp8 block scales: (rows, K) per scale
    rows_first: bool = False  # one value per row: [N, 1] or [N], not [1, N]


def _dims(src: TensorSource, name: str, expected: tuple[int, int] | None, k_per_elem: int) -> tuple[int, int]:
    """(N, K) to validate against: the config's when known, else from the main tensor itself."""
    if expected:
        return expected
    meta = src.meta.get(name)
    if meta is None:
        raise CheckpointError("tensor missing from the checkpoint", file=getattr(src, "model_dir", None), tensor=name)
    if len(meta.shape) != 2:
        raise CheckpointError(f"linear weight must be 2-D, got shape {list(meta.shape)}", file=meta.file, tensor=name)
    return meta.shape[0], meta.shape[1] * k_per_elem


def _global_is_a_divisor(module: str, main: str, src: TensorSource) -> bool:
    """compressed-tensors' `weight_global_scale` (a divisor) rather than ModelOpt's `weight_scale_2`; when neither
    is stored, the layout of the packed codes says which one is missing."""
    if f"{module}.weight_global_scale" in src.meta:
        return True
    if f"{module}.weight_scale_2" in src.meta:
        return False
    return main.endswith(".weight_packed")  # ModelOpt keeps its codes under `weight`


def _slots(module: str, fmt: str, src: TensorSource, expected: tuple[int, int] | None,
           scheme: QuantScheme | None = None) -> dict[str, _Slot]:
    if fmt == "dense":
        n, k = _dims(src, f"{module}.weight", expected, 1)
        return {"w": _Slot(f"{module}.weight", FLOAT_DTYPES, (n, k), "a 16-bit linear weight")}
    if fmt in ("mxfp4", "nvfp4"):
        # Quark and ModelOpt keep the packed codes under `weight`
        main = f"{module}.weight_packed" if f"{module}.weight_packed" in src.meta else f"{module}.weight"
        n, k = _dims(src, main, expected, 2)
        group = MX_BLOCK if fmt == "mxfp4" else NV_BLOCK
        if k % group:
            raise CheckpointError(f"K={k} is not a multiple of the {fmt} block {group}", tensor=main,
                                  file=_file_of(src, main))
        slots = {"packed": _Slot(main, (torch.uint8,), (n, k // 2), f"{fmt} packed e2m1 codes")}
        if fmt == "mxfp4":
            slots["scale"] = _Slot(f"{module}.weight_scale", (torch.uint8,) + E8M0_DTYPES, (n, k // group),
                                   "mxfp4 e8m0 scales")
        else:
            slots["scale"] = _Slot(f"{module}.weight_scale", (torch.float8_e4m3fn,), (n, k // group),
                                   "nvfp4 e4m3 block scales")
            if _global_is_a_divisor(module, main, src):
                slots["global"] = _Slot(f"{module}.weight_global_scale", FLOAT_DTYPES, None,
                                        "the nvfp4 global scale", (1,))
            else:  # ModelOpt: its reciprocal
                slots["global_inverse"] = _Slot(f"{module}.weight_scale_2", FLOAT_DTYPES, None,
                                                "the nvfp4 second-level scale (ModelOpt)", (1,))
        return slots
    if fmt == "fp8":
        n, k = _dims(src, f"{module}.weight", expected, 1)
        w8 = _Slot(f"{module}.weight", (torch.float8_e4m3fn,), (n, k), "an fp8 e4m3 weight")
        name = fp8_scale_name(module, src)
        meta = src.meta.get(name)
        said = scheme.scales if scheme is not None and scheme.format == "fp8" else ""
        blocks = fp8_block_of(meta.shape, n, k) if meta is not None and said != "rows" else None
        if said == "block" and scheme.block is not None:
            blocks = scheme.block  # the config's block: the scale's shape is checked against it
        if blocks is not None or name.endswith("_inv") or said == "block":
            rows, cols = blocks or (128, 128)
            return {"w8": w8, "scale": _Slot(name, FLOAT_DTYPES, (-(-n // rows), -(-k // cols)),
                                             f"fp8 block scales ({rows} x {cols} blocks)", block=(rows, cols))}
        return {"w8": w8, "scale": _Slot(name, FLOAT_DTYPES, None, "fp8 weight scales "
                                         f"(per-channel [{n}, 1], per-tensor or per block)", (1, n), rows_first=True)}
    raise CheckpointError(f"unknown weight format {fmt!r}", tensor=module)


def check_linear(module: str, fmt: str, src: TensorSource, expected: tuple[int, int] | None = None,
                 scheme: QuantScheme | None = None) -> dict:
    """Validate names, dtypes and shapes of one projection's tensors from the headers alone (`scheme`: what
    quantization_config says of them, where it says how the fp8 scales go)."""
    slots = _slots(module, fmt, src, expected, scheme)
    for slot in slots.values():
        meta = src.meta.get(slot.name)
        if meta is None:
            raise CheckpointError(f"tensor missing: {slot.what} of a {fmt} linear", tensor=slot.name,
                                  file=getattr(src, "model_dir", None))
        if meta.dtype not in slot.dtypes:
            allowed = " or ".join(str(d).replace("torch.", "") for d in slot.dtypes)
            raise CheckpointError(f"wrong dtype {meta.dtype_name} for {slot.what}, "
                                  f"expected {allowed}", file=meta.file, tensor=slot.name)
        if slot.shape is not None and tuple(meta.shape) != tuple(slot.shape):
            raise CheckpointError(f"wrong shape {list(meta.shape)} for {slot.what}, expected {list(slot.shape)}",
                                  file=meta.file, tensor=slot.name)
        numel = 1
        for dim in meta.shape:
            numel *= dim
        rows_last = slot.rows_first and numel > 1 and meta.shape[0] != numel  # a transposed per-channel scale
        if (slot.numel is not None and numel not in slot.numel) or rows_last:
            raise CheckpointError(f"wrong shape {list(meta.shape)} for {slot.what}", file=meta.file, tensor=slot.name)
    return slots


# leaves a linear may carry besides those its format reads: the bias (read on its own), activation scales and zero
# points of schemes served with dynamic activations, compressed-tensors' weight_shape
_SIDE_LEAVES = ("bias", "input_scale", "input_global_scale", "weight_zero_point", "input_zero_point", "weight_shape")


def check_no_stray_tensors(module: str, fmt: str, slots: dict[str, _Slot], names: list[str], src: TensorSource) -> None:
    """Each of the module's stored tensors `names` is one its format reads or a side leaf: any other one (a typo'd
    leaf, a 16-bit `weight` left beside MXFP4 packed codes) was dropped without a word."""
    read = {slot.name for slot in slots.values()}
    for name in names:
        if name not in read and name.rpartition(".")[2] not in _SIDE_LEAVES:
            leaves = ", ".join(sorted(n.rpartition(".")[2] for n in read))
            raise CheckpointError(f"tensor not used by the model: {module} is read as {fmt} from {leaves}",
                                  file=_file_of(src, name), tensor=name)


def read_linear(module: str, fmt: str, src: TensorSource, expected: tuple[int, int] | None = None,
                scheme: QuantScheme | None = None):
    """Read one projection's tensors into a Weight, validating every dtype and shape first."""
    slots = check_linear(module, fmt, src, expected, scheme)
    t = {role: src.get(slot.name) for role, slot in slots.items()}
    if "scale" in slots:
        check_scales(t["scale"], slots["scale"].what, _file_of(src, slots["scale"].name), slots["scale"].name)
    try:
        if fmt == "dense":
            return DenseWeight(t["w"])
        if fmt == "mxfp4":
            return Mxfp4Weight(t["packed"], t["scale"].view(torch.uint8))
        if fmt == "nvfp4":
            role = "global" if "global" in t else "global_inverse"
            value = t[role].float().reshape(1)
            if not bool(torch.isfinite(value).all()) or float(value) <= 0:
                raise CheckpointError(f"{slots[role].what} must be finite and positive, got {float(value)}",
                                      file=_file_of(src, slots[role].name), tensor=slots[role].name)
            return Nvfp4Weight(t["packed"], t["scale"], value if role == "global" else 1.0 / value)
        n, k = t["w8"].shape
        blocks = slots["scale"].block
        if blocks is not None:  # one scale per row and block of K: each block row's scales repeated on its rows
            rows, cols = blocks
            return Fp8Weight(t["w8"], t["scale"].float().repeat_interleave(rows, dim=0)[:n], block_k=cols)
        scale = t["scale"].float().reshape(-1, 1)
        return Fp8Weight(t["w8"], scale.expand(n, 1).contiguous() if scale.numel() == 1 else scale)
    except CheckpointError:
        raise
    except ValueError as exc:  # a container's own check: keep the module in the message
        raise CheckpointError(str(exc), tensor=module) from None


def check_scales(scale: torch.Tensor, what: str, file: str | None, tensor: str) -> None:
    """A NaN or negative scale is a broken checkpoint: say so here, naming it, not later in a codec or kernel
    that knows no names; so are scales that are all zero (the linear would serve as zeros: an FP8 k_proj whose
    weight_scale was all 0 loaded silently). Checked on the bytes for the 8-bit kinds (cheap: one scale per 16 or
    32 weights); e8m0 has no zero."""
    zero = None
    if scale.dtype == torch.uint8 or scale.dtype in E8M0_DTYPES:  # e8m0: 0xFF is NaN
        bad = scale.view(torch.uint8) == 0xFF
    elif scale.dtype == torch.float8_e4m3fn:  # e4m3fn: S1111111 is NaN, a set sign bit a negative scale
        raw = scale.view(torch.uint8)
        bad = ((raw & 0x7F) == 0x7F) | ((raw & 0x80) != 0) & ((raw & 0x7F) != 0)
        zero = (raw & 0x7F) == 0
    else:
        bad = ~torch.isfinite(scale) | (scale < 0)
        zero = scale == 0
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise CheckpointError(f"{what} hold a NaN, inf or negative value (first at index {where})",
                              file=file, tensor=tensor)
    if zero is not None and scale.numel() and bool(zero.all()):
        raise CheckpointError(f"{what} are all zero: the linear would serve as zeros (a broken conversion)",
                              file=file, tensor=tensor)


# ---------------------------------------------------------------------- writing


def split_partitions(weight) -> list:
    """A merged weight -> one weight per partition (each NVFP4 part keeps its own global scale)."""
    sizes = weight.partition_sizes
    if len(sizes) == 1:
        return [weight]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    parts = []
    for p in range(len(sizes)):
        a, b = bounds[p], bounds[p + 1]
        if isinstance(weight, Nvfp4Weight):
            parts.append(Nvfp4Weight(weight.packed[a:b], weight.scale[a:b], weight.global_scale[p:p + 1]))
        elif isinstance(weight, Mxfp4Weight):
            parts.append(Mxfp4Weight(weight.packed[a:b], weight.scale[a:b]))
        elif isinstance(weight, Fp8Weight):
            scale = weight.scale[a:b] if weight.scale.numel() > 1 else weight.scale
            parts.append(Fp8Weight(weight.w8[a:b], scale, block_k=weight.block_k))
        else:
            parts.append(DenseWeight(weight.tensor[a:b]))
    return parts


def _dense_dtype(dtype: torch.dtype, target: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16) else target


def weight_tensors(module: str, weight, dense_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One projection's weight -> its tensors in the compressed-tensors layout."""
    if isinstance(weight, Nvfp4Weight):
        return {f"{module}.weight_packed": weight.packed, f"{module}.weight_scale": weight.scale,
                f"{module}.weight_global_scale": weight.global_scale.float().reshape(1)}
    if isinstance(weight, Mxfp4Weight):
        return {f"{module}.weight_packed": weight.packed, f"{module}.weight_scale": weight.scale}
    if isinstance(weight, Fp8Weight):
        if weight.block_k:  # convert requantizes these per row (convert_linear): the layout written has no blocks
            raise ValueError("a block-scaled FP8 weight is written per channel: requantize it first")
        n = weight.shape[0]
        scale = weight.scale.float().reshape(-1, 1)
        return {f"{module}.weight": weight.w8, f"{module}.weight_scale": scale.expand(n, 1).contiguous()}
    tensor = weight.tensor
    return {f"{module}.weight": cast_16bit(tensor, _dense_dtype(tensor.dtype, dense_dtype))}


# plain tensors the models hold in fp32 whatever their dtype, written so: GLM-4.5's router correction bias (its
# releases store it fp32; in bf16 its small differences between experts, which decide picks, would round away) and
# Qwen3.5's linear-attention decay parameters (exp / softplus of them scale every state at every token)
FP32_LEAVES = ("e_score_correction_bias", "linear_attn.A_log", "linear_attn.dt_bias")


def plain_tensor(tensor: torch.Tensor, dense_dtype: torch.dtype = torch.bfloat16, name: str = "") -> torch.Tensor:
    """Non-linear tensors (embeddings, norms, biases): fp32 -> the 16-bit dtype (but FP32_LEAVES); 16-bit kept."""
    if tensor.dtype == torch.float32 and not name.endswith(FP32_LEAVES):
        return cast_16bit(tensor, dense_dtype)
    return tensor


def cast_16bit(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, refusing finite values that become inf (fp32 above 65504 cast to float16)."""
    out = tensor.to(dtype)
    if out.dtype != tensor.dtype and out.is_floating_point():
        overflow = torch.isinf(out) & torch.isfinite(tensor)
        if bool(overflow.any()):
            largest = float(tensor[overflow].abs().max())
            raise ValueError(f"a value of magnitude {largest:.6g} overflows {str(dtype).replace('torch.', '')}")
    return out
