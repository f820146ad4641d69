"""`radiance inspect`: what a checkpoint holds, per layer class, from its headers alone."""

from __future__ import annotations

import re
from collections import OrderedDict

from radiance.checkpoint.base import Checkpoint
from radiance.checkpoint.names import layer_kind
from radiance.checkpoint.servable import servability_problem

_LAYER = re.compile(r"\.layers\.\d+\.")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def _shape(shape, partitions=()) -> str:
    text = "[" + ", ".join(str(d) for d in shape) + "]"
    if len(partitions) > 1:
        text += " (" + "+".join(str(p) for p in partitions) + ")"
    return text


def _model_line(config: dict) -> str:
    parts = []
    for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
                       ("intermediate_size", "intermediate"), ("vocab_size", "vocab")):
        if config.get(key) is not None:
            parts.append(f"{label} {config[key]}")
    if config.get("num_attention_heads"):
        parts.append(f"heads {config['num_attention_heads']}/{config.get('num_key_value_heads') or config['num_attention_heads']} kv")
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        size = config.get("moe_intermediate_size") or config.get("intermediate_size")  # gpt-oss: the latter
        parts.append(f"experts {experts} (top {config.get('num_experts_per_tok')}) of {size}")
    if config.get("sliding_window") and config.get("layer_types"):
        sliding = sum(t == "sliding_attention" for t in config["layer_types"])
        parts.append(f"sliding window {config['sliding_window']} on {sliding} layers")
    if config.get("tie_word_embeddings"):
        parts.append("tied embeddings")
    if config.get("max_position_embeddings"):
        parts.append(f"max len {config['max_position_embeddings']}")
    return ", ".join(parts)


def inspect_lines(ckpt: Checkpoint, with_tokenizer: bool = False) -> list[str]:
    return inspect_report(ckpt, with_tokenizer)[0]


def inspect_report(ckpt: Checkpoint, with_tokenizer: bool = False) -> tuple[list[str], list[str]]:
    """(the lines `radiance inspect` prints, its warnings: first of all why radiance cannot serve the model)."""
    problem = servability_problem(ckpt)
    warnings = ([f"not servable: {problem}"] if problem else []) + list(ckpt.warnings)
    entries = ckpt.describe()
    lines = [f"model      {ckpt.path}", f"kind       {ckpt.kind}, {ckpt.architecture}",
             f"config     {_model_line(ckpt.config)}", f"quant      {ckpt.quant.describe()}"]
    if ckpt.kind == "gguf":
        kept = sorted({e.source_format for e in entries if e.format == "int4" and e.source_format})
        widened = sorted({e.source_format for e in entries if e.format != "int4" and e.source_format})
        if kept:  # Q4_0 / Q4_1 / Q4_K linears stay 4-bit for the CPU's int4 kernel
            lines[-1] += f"; GGUF {'/'.join(kept)} linears stay 4-bit (int4 on a CPU, dequantized elsewhere)"
        if widened:
            lines[-1] += f"; GGUF {'/'.join(widened)} tensors are dequantized at load"
    lines.append(f"servable   {'NO: ' + problem if problem else 'yes'}")
    template = ckpt.chat_template
    named = [name for name in getattr(ckpt, "chat_templates", {}) if name != "default"]  # tool_use, ...
    lines.append(f"generation eos ids {ckpt.eos_token_ids}, chat template {'yes' if template else 'no'}"
                 + (f" (named: {', '.join(named)})" if named else ""))
    if with_tokenizer:
        tok = ckpt.tokenizer()
        lines.append(f"tokenizer  {type(tok).__name__}, {len(tok)} tokens")

    linears: OrderedDict[tuple, list] = OrderedDict()
    others: OrderedDict[tuple, list] = OrderedDict()
    for e in entries:
        if e.is_linear:
            key = (layer_kind(e.name), e.format, e.shape, e.partition_sizes, e.source_format)
            linears.setdefault(key, []).append(e)
        else:
            key = (_LAYER.sub(".layers.*.", e.name), e.format, e.shape, e.source_format)
            others.setdefault(key, []).append(e)
    width = max([14] + [len(kind) + 1 for kind, *_ in linears])  # experts.gate_up_proj: 21
    lines += ["", "linears (per layer class)",
              f"  {'class':<{width}}{'count':>6}  {'format':<8}{'shape [N, K] (partitions)':<32}{'bytes':>11}"]
    for (kind, fmt, shape, parts, source), group in linears.items():
        note = f"  stored {source}" if source else ""
        lines.append(f"  {kind:<{width}}{len(group):>6}  {fmt:<8}{_shape(shape, parts):<32}"
                     f"{_mib(sum(e.nbytes for e in group)):>11}{note}")
    if not linears:
        lines.append("  (none)")
    lines += ["", "other tensors", f"  {'name':<46}{'count':>6}  {'dtype':<10}{'shape':<16}{'bytes':>11}"]
    for (name, fmt, shape, source), group in others.items():
        note = f"  stored {source}" if source else ""
        lines.append(f"  {name:<46}{len(group):>6}  {fmt:<10}{_shape(shape):<16}"
                     f"{_mib(sum(e.nbytes for e in group)):>11}{note}")
    if ckpt.attention_scales:  # calibrated fp8 KV-cache scales (applied with --kv-cache-dtype fp8)
        for kind in ("k_scale", "v_scale"):
            values = [v for n, v in ckpt.attention_scales.items() if n.endswith(kind)]
            if values:
                lines.append(f"  fp8 KV-cache {kind:<8} {len(values):>4} layers, "
                             f"{min(values):.4g} .. {max(values):.4g}")
    total = sum(e.nbytes for e in entries)
    lines += ["", f"total      {len(entries)} entries, {_mib(total)}"]
    lines += ["", f"warnings   {len(warnings) or 'none'}"] + [f"  - {w}" for w in warnings]
    return lines, warnings
