"""Builds the module that serves one checkpoint linear, as the `quantization` option decides.

auto:  MXFP4 as is; NVFP4 / FP8 requantized to MXFP4 (ModelConfig.rule); 16-bit stays 16-bit; 4-bit GGUF
       (Int4Weight) on a CPU runs from its codes (KernelConfig.cpu_int4), elsewhere dequantized to 16 bit.
mxfp4: 16-bit linears are quantized to MXFP4 too.
A linear ModelConfig.ignore selects (radiance's linear name or the checkpoint modules it is made of,
convert.IgnoreSelection) is served 16-bit under auto, mxfp4 and nvfp4: a 16-bit one as it is, one stored quantized
as its dequantized values (a layer whose MXFP4 requantization hurts, a shape the W4A8 kernel does not take).
nvfp4: 16-bit linears are quantized to NVFP4, then requantized to MXFP4 with the rule, or with rule
       "none" served as the dequantized NVFP4 values in 16 bit (W4A16 emulation of an NVFP4 model).
none:  everything dequantized to 16 bit.
Quantized linears become `radiance.layers.linear.Mxfp4Linear`, 16-bit ones `DenseLinear`, 4-bit GGUF ones
on a CPU `radiance.layers.int4_linear.Int4Linear`. Apart from that one path, an Int4Weight is treated as the
16-bit weight of its values.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radiance.checkpoint.convert import selects
from radiance.checkpoint.layout import cast_16bit
from radiance.config import KernelConfig, ModelConfig
from radiance.formats import DenseWeight, Nvfp4Weight, dense_to_mxfp4_pair, dequantize, quantize_nvfp4
from radiance.layers.int4_linear import Int4Linear, int4_cpu_unsupported
from radiance.layers.linear import DenseLinear, Mxfp4Linear, Mxfp4PairLinear

log = logging.getLogger(__name__)


class Overflow16Bit(ValueError):
    """A finite weight value that the serving dtype holds only as inf (a float32 value above 65504 in float16)."""


def to_serving_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`; Overflow16Bit where a finite value would become inf. Checked only into float16 (from
    float32 or bfloat16: |x| > 65504), the one serving dtype whose range is short; other casts cost no extra pass."""
    if dtype != torch.float16 or tensor.dtype == torch.float16 or not tensor.is_floating_point():
        return tensor.to(dtype)
    try:
        return cast_16bit(tensor, dtype)
    except ValueError as exc:
        raise Overflow16Bit(str(exc)) from None


def build_linear(name: str, weight, model_config: ModelConfig, kernel_config: KernelConfig,
                 dtype: torch.dtype) -> tuple[nn.Module, str, float]:
    """(module, how it is served: "dense" | "mxfp4" | "int4" | "<format>-dequant" (rule none: a quantized weight
    served 16-bit, NVFP4's or one stored in another format), requant relRMS or 0)."""
    quant = model_config.quantization
    # a pattern selecting only some parts of a merged linear (q_proj of qkv_proj) is a ConfigError: the loader names
    # the linear with it
    keep_16bit = selects(model_config.ignore, name, len(weight.partition_sizes))
    if weight.format == "int4":
        if quant == "auto" and not keep_16bit and kernel_config.cpu_int4:
            why_not = int4_cpu_unsupported(weight, weight.packed.device)
            if why_not is None:
                return Int4Linear(weight, name=name), "int4", 0.0
            if weight.packed.device.type == "cpu":
                log.warning("%s: served dequantized, not on the int4 CPU kernel: %s", name, why_not)
        weight = DenseWeight(dequantize(weight), weight.partition_sizes)
    if quant == "none":
        tensor = dequantize(weight) if weight.format != "dense" else weight.tensor
        return DenseLinear(to_serving_dtype(tensor, dtype), name=name), "dense", 0.0
    if keep_16bit and weight.format != "dense":  # asked 16-bit: a linear stored quantized serves its values
        return DenseLinear(to_serving_dtype(dequantize(weight), dtype), name=name), f"{weight.format}-dequant", 0.0
    if weight.format == "dense" and (quant == "auto" or keep_16bit):
        return DenseLinear(to_serving_dtype(weight.tensor, dtype), name=name), "dense", 0.0
    if weight.format == "dense" and quant == "nvfp4":
        packed, scale, global_scale = quantize_nvfp4(weight.tensor.float(), weight.partition_sizes)
        weight = Nvfp4Weight(packed, scale, global_scale, weight.partition_sizes)
    if model_config.rule == "none":  # only valid with nvfp4 (config checks): serve the NVFP4 values in 16 bit
        # (a weight stored in another format, MXFP4 or FP8, is served dequantized too, and says so)
        return DenseLinear(to_serving_dtype(dequantize(weight), dtype), name=name), f"{weight.format}-dequant", 0.0
    module, err = Mxfp4Linear.from_weight(weight, model_config.rule, kernel_config, name=name)
    return module, "mxfp4", float(err)


def build_lm_head(weight, model_config: ModelConfig, kernel_config: KernelConfig,
                  dtype: torch.dtype) -> tuple[nn.Module, str, float]:
    """The lm_head when it is quantized (ModelConfig.quantize_lm_head, or stored quantized), as build_linear
    returns it. lm_head_format "mxfp4": like any linear; "mxfp4x2": two MXFP4 terms of its values
    (Mxfp4PairLinear), except for a head stored as MXFP4, which one term already holds exactly."""
    if model_config.lm_head_format != "mxfp4x2" or weight.format == "mxfp4":
        return build_linear("lm_head", weight, model_config, kernel_config, dtype)
    tensor = weight.tensor if weight.format == "dense" else dequantize(weight)
    packed, scale, err = dense_to_mxfp4_pair(tensor, model_config.rule)
    return Mxfp4PairLinear(packed, scale, None, kernel_config, "lm_head"), "mxfp4x2", err
