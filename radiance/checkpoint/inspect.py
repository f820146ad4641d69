"""`radiance inspect`: what a checkpoint holds, per layer class, from its headers alone (with --values, also
every weight's values: values.py)."""

from __future__ import annotations

import re
from collections import OrderedDict

from radiance.checkpoint.base import Checkpoint
from radiance.checkpoint.names import layer_kind
from radiance.checkpoint.servable import servability_problem
from radiance.checkpoint.values import value_warnings
from radiance.models.moe_config import expert_count

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
    experts = expert_count(config)
    if experts:
        size = config.get("moe_intermediate_size") or config.get("intermediate_size")  # gpt-oss: the latter
        parts.append(f"experts {experts} (top {config.get('num_experts_per_tok')}) of {size}")
    if config.get("tie_word_embeddings"):
        parts.append("tied embeddings")
    if config.get("max_position_embeddings"):
        parts.append(f"max len {config['max_position_embeddings']}")
    context = _yarn_context(config)
    if context is not None:
        parts.append(f"YaRN context {context}")
    return ", ".join(parts)


def _yarn_context(config: dict) -> int | None:
    """The context YaRN gives (original x factor, ArchConfig.context_length) where it differs from
    max_position_embeddings; None otherwise, or for a config the registry refuses."""
    from radiance.errors import ConfigError
    from radiance.models.registry import resolve_architecture

    try:
        cfg = resolve_architecture(config)[1]
    except ConfigError:
        return None
    return cfg.context_length if cfg.context_length != cfg.max_position_embeddings else None


def _layer_list(layers: list[int]) -> str:
    """Sorted layer indices, readable: "28-35", "0, 2, 4, ..., 22" (a regular stride), "0-3, 8"."""
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    if len(layers) > 4 and step > 1 and layers == list(range(layers[0], layers[-1] + 1, step)):
        return f"{', '.join(map(str, layers[:3]))}, ..., {layers[-1]}"
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _attention_line(config: dict) -> str | None:
    """Which layers attend through a sliding window (or within chunks: Llama 4), as the model will serve them
    (transformers' rules: Qwen's use_sliding_window / max_window_layers, gpt-oss's layer_types or their alternating
    default);
    None for a config the model registry refuses (the servable line says why)."""
    from radiance.errors import ConfigError
    from radiance.models.registry import resolve_architecture

    declared = config.get("sliding_window")
    try:
        cfg = resolve_architecture(config)[1]
    except ConfigError:  # e.g. Phi-3: what config.json says, for the servable line's refusal to explain
        return f"config.json gives a sliding window of {declared} tokens" if declared else None
    if cfg.linear_layers:  # Qwen3.5 (no sliding windows)
        full = cfg.attention_layer_ids
        return (f"Gated DeltaNet linear attention on {len(cfg.linear_layers)} of {cfg.num_layers} layers, full "
                f"causal on layers {_layer_list(full)}" if full else "no full-attention layer")
    if cfg.chunked_layers:  # Llama 4 (no sliding windows)
        chunked = sorted(cfg.chunked_layers)
        rest = "full causal on the others" if len(chunked) < cfg.num_layers else "no full-attention layer"
        return (f"chunks of {cfg.attention_chunk} tokens on layers {_layer_list(chunked)} ({len(chunked)} of "
                f"{cfg.num_layers}), {rest}")
    layers = sorted(cfg.sliding_layers)
    caps = "".join(f", {what} logits soft-capped at {cap:g}" for what, cap in
                   (("attention", cfg.attn_softcap), ("output", cfg.final_softcap)) if cap is not None)
    if not layers:
        unused = (f" (config.json's sliding_window {declared} is off for {cfg.architecture}, as in transformers)"
                  if declared else "")
        every = "the one layer" if cfg.num_layers == 1 else f"all {cfg.num_layers} layers"
        return f"full causal on {every}{unused}{caps}"
    rest = "full causal on the others" if len(layers) < cfg.num_layers else "no full-attention layer"
    return (f"sliding window {cfg.sliding_window} tokens on layers {_layer_list(layers)} "
            f"({len(layers)} of {cfg.num_layers}), {rest}{caps}")


def _kv_line(config: dict) -> str | None:
    """The 16-bit KV cache a sequence of the model's whole context takes, all layers keeping every token, and with
    the local layers' blocks released (engine.kv_layout, the default); None for a config the registry refuses."""
    from radiance.config import CacheConfig, SchedulerConfig
    from radiance.engine.kv_layout import KvLayout
    from radiance.errors import ConfigError
    from radiance.models.registry import resolve_architecture

    try:
        cfg = resolve_architecture(config)[1]
    except ConfigError:
        return None
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V of one token in 16 bits
    context, block = cfg.context_length, CacheConfig().block_size
    layers = len(cfg.attention_layer_ids)
    line = (f"{_mib(per_layer * layers)} per token in 16 bits; a sequence of the whole context "
            f"({context} tokens): {_gib(per_layer * layers * context)}")
    la = cfg.linear_attention
    if cfg.linear_layers and la is not None:  # a state per sequence instead (engine.state_cache)
        state = (la.conv_channels * (la.conv_kernel - 1) * 2  # the conv tail in 16 bits, the float32 state
                 + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4)
        line += (f"; the {len(cfg.linear_layers)} linear-attention layers keep {_mib(state * len(cfg.linear_layers))} "
                 "of state per sequence instead, whatever its length")
    layout = KvLayout.of(cfg)
    if layout.releases_pages:
        pages = layout.pages_for(context, block, SchedulerConfig().max_num_batched_tokens)
        line += (f", {_gib(pages * block * layout.slots * per_layer)} with the local layers' blocks released "
                 f"({layout.num_groups} groups of {layout.slots} layers)")
    return line


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else _mib(nbytes)


def _rotary_line(config: dict) -> str | None:
    """What is unusual about the model's rotary embedding (LongRoPE's two factor sets, a partial rotary, NoPE
    layers, sliding layers with a base of their own); None when nothing is, or for a config the registry refuses."""
    from radiance.errors import ConfigError
    from radiance.models.registry import resolve_architecture

    try:
        cfg = resolve_architecture(config)[1]
    except ConfigError:
        return None
    parts = []
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        original = cfg.rope_scaling["original_max_position_embeddings"]
        parts.append(f"LongRoPE: the short factors for a max_model_len up to {original}, the long ones above it")
    if cfg.rotary_dim is not None:
        parts.append(f"{cfg.rotary_dim} of {cfg.head_dim} dims per head rotate")
    if cfg.nope_layers:
        parts.append(f"no rotary (NoPE) on layers {_layer_list(sorted(cfg.nope_layers))}")
    if cfg.sliding_rope_theta is not None:
        parts.append(f"sliding layers rotate with base {_base(cfg.sliding_rope_theta)}, the others "
                     f"{_base(cfg.rope_theta)}")
    return "; ".join(parts) or None


def _base(theta: float) -> str:
    return f"{theta:.0f}" if float(theta).is_integer() else f"{theta:g}"


def _gguf_quant(entries) -> str | None:
    """A GGUF's quantization by tensor type (it has no quantization_config: its quant reads "none"); None when
    every tensor is 16/32-bit."""
    kept = sorted({e.source_format for e in entries if e.format == "int4" and e.source_format})
    mxfp4 = any(e.format == "mxfp4" for e in entries)
    widened = sorted({e.source_format for e in entries if e.format not in ("int4", "mxfp4") and e.source_format})
    parts = []
    if kept:  # Q4_0 / Q4_1 / Q4_K linears stay 4-bit for the CPU's int4 kernel
        parts.append(f"GGUF {'/'.join(kept)} linears stay 4-bit (int4 on a CPU, dequantized elsewhere)")
    if mxfp4:  # gpt-oss's experts
        parts.append("GGUF MXFP4 linears are served as MXFP4")
    if widened:
        parts.append(f"GGUF {'/'.join(widened)} tensors are dequantized at load")
    return "; ".join(parts) or None


def inspect_lines(ckpt: Checkpoint, with_tokenizer: bool = False) -> list[str]:
    return inspect_report(ckpt, with_tokenizer)[0]


def inspect_report(ckpt: Checkpoint, with_tokenizer: bool = False, with_values: bool = False,
                   progress: bool = True) -> tuple[list[str], list[str]]:
    """(the lines `radiance inspect` prints, its warnings: first of all why radiance cannot serve the model);
    `with_values` reads every weight too (values.py)."""
    problem = servability_problem(ckpt)
    warnings = ([f"not servable: {problem}"] if problem else []) + list(ckpt.warnings)
    if not ckpt.has_tokenizer:
        warnings.append("no tokenizer: only token-id prompts can be served (no text, no chat)")
    warnings += _template_warnings(ckpt)
    if with_tokenizer and ckpt.has_tokenizer:
        warnings += _tokenizer_warnings(ckpt)
    values_line = None
    if with_values and not problem:  # an unservable layout is not read: its reader may not know its tensors
        read, faults = value_warnings(ckpt, progress)
        warnings += faults
        values_line = f"values     {read} weights read: " + (f"{len(faults)} faulty (warnings)" if faults
                                                               else "all finite")
    entries = ckpt.describe()
    lines = _header_lines(ckpt, entries, problem, with_tokenizer)
    if values_line:
        lines.append(values_line)
    lines += _linear_table(entries) + _other_table(entries) + _kv_scale_lines(ckpt.attention_scales)
    lines += ["", f"total      {len(entries)} entries, {_mib(sum(e.nbytes for e in entries))}"]
    lines += ["", f"warnings   {len(warnings) or 'none'}"] + [f"  - {w}" for w in warnings]
    return lines, warnings


def _tokenizer_warnings(ckpt: Checkpoint) -> list[str]:
    """A tokenizer with more tokens than the model's vocabulary: text that encodes to the ids past it is refused at
    request time ("token id(s) outside the vocabulary"). Fewer is common (padded embeddings) and fine."""
    vocab, tokens = ckpt.config.get("vocab_size"), len(ckpt.tokenizer())
    if isinstance(vocab, int) and tokens > vocab:
        return [f"the tokenizer has {tokens} tokens, the model's vocabulary {vocab}: text holding the {tokens - vocab} "
                f"past it is refused at request time"]
    return []


def _template_warnings(ckpt: Checkpoint) -> list[str]:
    """One warning per chat template that does not parse (each is compiled as generate and serve compile it), naming
    the file it was read from."""
    from radiance.server.chat_template import template_errors

    return [str(exc) if name == "default" else f"{exc} (the {name!r} template)" for name, exc in template_errors(ckpt)]


def _header_lines(ckpt: Checkpoint, entries, problem: str | None, with_tokenizer: bool) -> list[str]:
    """What the model is: path, kind, config, attention and rotary, quantization, servability, generation."""
    served_from = ckpt.config.get("served_from")  # a vision-language model: its language model alone
    kind = f"{ckpt.kind}, {ckpt.architecture}" + (f" (the language model of {served_from})" if served_from else "")
    lines = [f"model      {ckpt.path}", f"kind       {kind}",
             f"config     {_model_line(ckpt.config)}"]
    attention = _attention_line(ckpt.config)
    if attention:
        lines.append(f"attention  {attention}")
    kv = _kv_line(ckpt.config)
    if kv:
        lines.append(f"kv cache   {kv}")
    rotary = _rotary_line(ckpt.config)
    if rotary:
        lines.append(f"rotary     {rotary}")
    quant = (_gguf_quant(entries) if ckpt.kind == "gguf" else None) or ckpt.quant.describe()
    lines.append(f"quant      {quant}")
    lines.append(f"servable   {'NO: ' + problem if problem else 'yes'}")
    named = [name for name in ckpt.chat_templates if name != "default"]  # tool_use, ...
    lines.append(f"generation eos ids {ckpt.eos_token_ids}, chat template {'yes' if ckpt.chat_template else 'no'}"
                 + (f" (named: {', '.join(named)})" if named else "")
                 + ("" if ckpt.has_tokenizer else ", no tokenizer"))
    if with_tokenizer and ckpt.has_tokenizer:
        tok = ckpt.tokenizer()
        lines.append(f"tokenizer  {type(tok).__name__}, {len(tok)} tokens")
    return lines


def _linear_table(entries) -> list[str]:
    """The linears grouped by layer class, format, shape and partitions."""
    linears: OrderedDict[tuple, list] = OrderedDict()
    for e in entries:
        if e.is_linear:
            key = (layer_kind(e.name), e.format, e.shape, e.partition_sizes, e.source_format)
            linears.setdefault(key, []).append(e)
    width = max([14] + [len(kind) + 1 for kind, *_ in linears])  # experts.gate_up_proj: 21
    lines = ["", "linears (per layer class)",
             f"  {'class':<{width}}{'count':>6}  {'format':<8}{'shape [N, K] (partitions)':<32}{'bytes':>11}"]
    for (kind, fmt, shape, parts, source), group in linears.items():
        note = f"  stored {source}" if source else ""
        lines.append(f"  {kind:<{width}}{len(group):>6}  {fmt:<8}{_shape(shape, parts):<32}"
                     f"{_mib(sum(e.nbytes for e in group)):>11}{note}")
    if not linears:
        lines.append("  (none)")
    return lines


def _other_table(entries) -> list[str]:
    """The other tensors (embeddings, norms, biases, ...), each layer's copy counted under one name."""
    others: OrderedDict[tuple, list] = OrderedDict()
    for e in entries:
        if not e.is_linear:
            others.setdefault((_LAYER.sub(".layers.*.", e.name), e.format, e.shape, e.source_format), []).append(e)
    name_width = max([46] + [len(name) + 1 for name, *_ in others])  # Gemma 3's pre_feedforward_layernorm: 52
    shape_width = max([16] + [len(_shape(shape)) + 1 for _, _, shape, _ in others])
    lines = ["", "other tensors",
             f"  {'name':<{name_width}}{'count':>6}  {'dtype':<10}{'shape':<{shape_width}}{'bytes':>11}"]
    for (name, fmt, shape, source), group in others.items():
        note = f"  stored {source}" if source else ""
        lines.append(f"  {name:<{name_width}}{len(group):>6}  {fmt:<10}{_shape(shape):<{shape_width}}"
                     f"{_mib(sum(e.nbytes for e in group)):>11}{note}")
    return lines


def _kv_scale_lines(attention_scales: dict) -> list[str]:
    """Calibrated fp8 KV-cache scales (applied with --kv-cache-dtype fp8): their range per kind."""
    lines = []
    for kind in ("k_scale", "v_scale"):
        values = [v for n, v in attention_scales.items() if n.endswith(kind)]
        if values:
            lines.append(f"  fp8 KV-cache {kind:<8} {len(values):>4} layers, {min(values):.4g} .. {max(values):.4g}")
    return lines
