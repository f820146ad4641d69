"""Hugging Face model directories: config.json + safetensors (16-bit, compressed-tensors, Quark).

Everything that can be checked from the headers is checked when the checkpoint is opened (missing
tensors, wrong shapes and dtypes, config/tensor disagreements), so a broken checkpoint fails in a
second with a message naming file and tensor, not minutes into a load. The tokenizer is hf_tokenizer's.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm

from radiance.checkpoint.base import Checkpoint, EntryInfo
from radiance.checkpoint.decoder_tensors import first_missing, needed_decoder_tensors
from radiance.checkpoint.hf_config import (chat_template_files, eos_token_ids, expected_shapes,
                                           language_model, load_config, modelopt_quant_file,
                                           quantization_config, tensor_renames)
from radiance.checkpoint.hf_tokenizer import has_tokenizer_files, load_tokenizer
from radiance.checkpoint.layout import (FLOAT_DTYPES, check_linear, check_no_stray_tensors, detect_format, read_linear,
                                        required_tensors)
from radiance.checkpoint.names import (ATTENTION_SCALE_SUFFIXES, QUANT_SUFFIXES, canonical_linear, is_linear_module,
                                       leaf, partition_modules, sort_key, split_tensor_name)
from radiance.checkpoint.quant_config import parse_quantization_config
from radiance.checkpoint.safetensors_io import SafetensorsIndex
from radiance.checkpoint.stacked_experts import find_stacked_experts, read_stacked_experts
from radiance.errors import CheckpointError
from radiance.formats import DenseWeight, concat_partitions, dequantize

logger = logging.getLogger(__name__)

_DECODER_PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")
_EXPERT_PROJ = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj$")
_LINEAR_ATTN_PROJ = re.compile(r"^model\.layers\.\d+\.linear_attn\.(in_proj_\w+|out_proj)$")


# buffers older exports saved with the weights (transformers < 4.31 Llama: rotary_emb.inv_freq in every layer);
# radiance computes them from config.json, as transformers and vLLM do when they skip them
_DERIVED_LEAVES = ("inv_freq", "cos_cached", "sin_cached")


def _is_derived_buffer(module: str, leafname: str) -> bool:
    return leafname in _DERIVED_LEAVES and leaf(module) == "rotary_emb"


@dataclass
class _Linear:
    canonical: str
    modules: tuple[str, ...]  # checkpoint projections, partition order
    formats: tuple[str, ...]  # stored format of each projection
    schemes: tuple = ()  # what quantization_config says of each (QuantScheme)


@dataclass
class _Classified:
    """The stored tensors by role (HfCheckpoint._classify_tensors)."""
    parts: dict[str, dict[int, str]] = field(default_factory=dict)  # linear -> partition index -> stored module
    module_tensors: dict[str, list[str]] = field(default_factory=dict)  # each stored linear module's tensors
    biases: dict[str, dict[int, str]] = field(default_factory=dict)  # a merged linear's bias -> partition -> tensor
    plain: list[str] = field(default_factory=list)  # embeddings, norms, a linear's own bias, ...
    attention_scales: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)  # rotary buffers the model computes itself


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")  # a decoder layer (not a vision tower's)


class HfCheckpoint(Checkpoint):
    def __init__(self, path: str):
        path = os.path.abspath(path)
        config = load_config(path)
        self.config_file = os.path.join(path, "config.json")
        text_only = language_model(config, self.config_file)  # a vision-language model: its language model
        config = text_only or config
        qc, qc_file = quantization_config(config, self.config_file), self.config_file
        if qc is None:
            qc, qc_file = modelopt_quant_file(path)
        quant = parse_quantization_config(qc, qc_file)
        super().__init__(path=path, kind="hf", config=config, quant=quant, warnings=quant.warnings)
        self.index = SafetensorsIndex(path, rename=tensor_renames(config, text_only is not None))
        if self.index.skipped and text_only:
            logger.info("serving the language model of %s: %d other tensors (vision tower, projector) not read, "
                        "e.g. %s", config["served_from"], len(self.index.skipped), self.index.skipped[0])
        elif self.index.skipped:
            logger.info("%d tensors of the layers past num_hidden_layers=%s (a multi-token-prediction module, which "
                        "radiance does not run) not read, e.g. %s", len(self.index.skipped),
                        config.get("num_hidden_layers"), self.index.skipped[0])
        self._module_tensors: dict[str, list[str]] = {}
        # the modules' names in the files, which quantization_config's targets and exclusions name
        self._stored_module: dict[str, str] = {}
        for name, meta in self.index.meta.items():
            module = split_tensor_name(name)[0]
            self._module_tensors.setdefault(module, []).append(name)
            self._stored_module[module] = split_tensor_name(meta.stored)[0]
        self._shapes = expected_shapes(config)
        try:
            self._stacked = find_stacked_experts(self.index, config)  # gpt-oss: all experts in one tensor
            self._linears, self._plain, self._biases = self._plan()
        except CheckpointError as exc:  # a tensor "missing" may be in a shard the index leaves out: named
            raise self.index.unlisted_note(exc) from None
        # a tied lm_head is still a Linear module of the model, so naming it in ignore is right
        virtual = ["lm_head"] if self.tie_word_embeddings else []
        skipped = sorted({split_tensor_name(name)[0] for name in self.index.skipped})  # exclusions may name them
        self.quant.check_modules(sorted(self._stored_module.values()) + skipped + virtual)
        self._tokenizer = None
        self._eos_token_ids = eos_token_ids(path, config, self.warn)  # at open: inspect lists its warning

    def config_error(self, exc: Exception) -> Exception:
        """A fault the model registry finds in config.json, with the file named (the registry sees only the dict)."""
        if self.config_file in str(exc):
            return exc
        return type(exc)(f"{exc} (file {self.config_file})")

    # ------------------------------------------------------------------ planning (headers only)

    def _expected(self, module: str) -> tuple[int, int] | None:
        if _DECODER_PROJ.match(module) or module == "lm_head":
            return self._shapes.get(leaf(module))
        if _EXPERT_PROJ.match(module):
            return self._shapes.get(f"experts.{leaf(module)}")
        if _LINEAR_ATTN_PROJ.match(module):
            return self._shapes.get(f"linear_attn.{leaf(module)}")
        return None

    def _check_layer_exists(self, module: str) -> None:
        """A linear of a layer past num_hidden_layers is a tensor the model has no place for (it was reported as its
        q / k / v siblings missing, naming the directory)."""
        layer = _LAYER_INDEX.search(module)
        layers = self.config.get("num_hidden_layers")
        if layer and isinstance(layers, int) and int(layer.group(1)) >= layers:
            tensor = next(t for t in self.index.meta if t.startswith(module + "."))
            raise CheckpointError(f"tensor of layer {layer.group(1)}, but config.json has num_hidden_layers "
                                  f"{layers}: not used by the model", file=self.file_of(tensor), tensor=tensor)

    def _plan(self):
        """(the linears with their stored partitions and formats, the plain tensors, the biases of merged linears),
        each linear's tensors checked from the headers; also warns where quantization_config and the stored
        formats disagree, and reads the calibrated attention scales."""
        tensors = self._classify_tensors()
        mismatches: dict[tuple[str, str, str], list[str]] = {}
        linears = [self._plan_linear(canonical, found, tensors.module_tensors, mismatches)
                   for canonical, found in tensors.parts.items()]
        self._warn_format_mismatches(mismatches)
        self._warn_mixed_partitions(linears)
        if tensors.derived:
            logger.info("skipping %d rotary buffer(s) the model computes itself (e.g. %s)", len(tensors.derived),
                        tensors.derived[0])
        self._check_plain(tensors.plain + [part for parts in tensors.biases.values() for part in parts.values()])
        self._check_complete(linears, tensors.plain)
        if tensors.attention_scales:
            self._read_attention_scales(tensors.attention_scales)
        return (sorted(linears, key=lambda e: sort_key(e.canonical)), sorted(tensors.plain, key=sort_key),
                tensors.biases)

    def _classify_tensors(self) -> "_Classified":
        """Every stored tensor by role: a linear's part, a merged linear's bias, a plain tensor, an attention
        scale, or a buffer the model derives itself (stacked experts are read by their own plan)."""
        out = _Classified()
        stacked = {name for group in self._stacked.values() for name in group.tensor_names()}
        for name in self.index.meta:
            if name in stacked:
                continue
            module, leafname = split_tensor_name(name)
            if _is_derived_buffer(module, leafname):
                out.derived.append(name)
            elif leafname in ATTENTION_SCALE_SUFFIXES:
                out.attention_scales.append(name)
            elif is_linear_module(module) or leafname in QUANT_SUFFIXES:
                canonical, index = canonical_linear(module)
                if leafname != "bias":
                    parts = out.parts.setdefault(canonical, {})
                    if module not in parts.values() and parts and canonical in (module, *parts.values()):
                        other = next(m for m in parts.values() if m != module)
                        raise CheckpointError(f"{canonical} is stored both whole and as its parts ({leaf(other)}, "
                                              f"{leaf(module)}): one would be served and the other ignored",
                                              file=self.index.meta[name].file, tensor=name)
                    parts[index] = module
                    out.module_tensors.setdefault(module, []).append(name)
                elif canonical != module:
                    out.biases.setdefault(f"{canonical}.bias", {})[index] = name
                else:
                    out.plain.append(name)
            else:
                out.plain.append(name)
        return out

    def _plan_linear(self, canonical: str, found: dict[int, str], module_tensors: dict[str, list[str]],
                     mismatches: dict[tuple[str, str, str], list[str]]) -> "_Linear":
        """One linear: its stored modules (the partitions, or the merged module itself), each one's format as
        stored, checked complete and free of stray tensors; a format quantization_config did not say goes into
        `mismatches`."""
        self._check_layer_exists(next(iter(found.values())))
        # a checkpoint may already store the merged module (one partition)
        modules = (canonical,) if found.get(0) == canonical else partition_modules(canonical)
        formats, schemes = [], []
        for module in modules:
            scheme = self.quant.scheme_for(self._stored_module.get(module, module), linear=True)
            detected = detect_format(module, self.index)
            missing = [t for t in required_tensors(module, scheme.format, scheme.layout) if t not in self.index]
            if detected is None or (detected == "dense" and missing and not self._holds_floats(f"{module}.weight")):
                # Quark / ModelOpt keep packed codes under `weight`: without their scale they looked 16-bit
                raise CheckpointError("tensor missing from the checkpoint", file=self.path,
                                      tensor=(missing or [f"{module}.weight"])[0])
            if detected != scheme.format:
                mismatches.setdefault((scheme.format, detected, leaf(module)), []).append(module)
            slots = check_linear(module, detected, self.index, self._expected(module), scheme)
            check_no_stray_tensors(module, detected, slots, module_tensors.get(module, []), self.index)
            formats.append(detected)
            schemes.append(scheme)
        return _Linear(canonical, modules, tuple(formats), tuple(schemes))

    def _warn_mixed_partitions(self, linears: list["_Linear"]) -> None:
        """A merged linear whose parts are stored in different formats (an NVFP4 in_proj_qkv beside a 16-bit
        in_proj_z) is read as 16-bit values (one kernel serves one format): said once per kind at open."""
        mixed: dict[tuple, list[_Linear]] = {}
        for entry in linears:
            if len(set(entry.formats)) > 1:
                mixed.setdefault((leaf(entry.canonical), tuple(map(leaf, entry.modules)), entry.formats),
                                 []).append(entry)
        for (kind, parts, formats), entries in mixed.items():
            stored = ", ".join(f"{part} {fmt}" for part, fmt in zip(parts, formats))
            self.warn(f"{len(entries)} {kind} linear(s) (e.g. {entries[0].canonical}) store their parts in different "
                      f"formats ({stored}): served as one linear, each is read as its 16-bit values")

    def _holds_floats(self, name: str) -> bool:
        return self.index.meta[name].dtype in FLOAT_DTYPES

    def _warn_format_mismatches(self, mismatches: dict[tuple[str, str, str], list[str]]) -> None:
        """Modules stored in another format than quantization_config says: read as stored, said once per kind."""
        for (said, stored, kind), modules in mismatches.items():
            if self.quant.method == "none":  # no quantization_config: nothing said they were dense
                self.warn(f"config.json has no quantization_config, but {len(modules)} {kind} module(s) (e.g. "
                          f"{modules[0]}) are stored as {stored}; reading them as stored")
                continue
            fix = (f"add {kind!r} modules to quantization_config ignore" if stored == "dense"
                   else "check the quantization_config targets")
            self.warn(f"quantization_config says {len(modules)} {kind} module(s) (e.g. {modules[0]}) are "
                      f"{said} but they are stored as {stored}; reading them as stored ({fix})")

    def _read_attention_scales(self, names: list[str]) -> None:
        """Calibrated attention scales: k_scale / v_scale (compressed-tensors on self_attn, ModelOpt on k_proj /
        v_proj; an old single kv_scale serves both) become `attention_scales`, which an fp8 KV cache stores
        against; q_scale / prob_scale (fp8 attention math) are not used, said once. A scale with several
        values (per head) keeps its largest: nothing saturates, small values lose some precision."""
        unused = []
        for name in names:
            module, leafname = split_tensor_name(name)
            value = self.index.get(name).float()
            if value.numel() == 0 or not torch.isfinite(value).all() or not bool((value > 0).all()):
                raise CheckpointError("an attention scale must be positive and finite",
                                      file=self.index.meta[name].file, tensor=name)
            if leafname not in ("k_scale", "v_scale", "kv_scale"):
                unused.append(name)
                continue
            attn = module.rsplit(".", 1)[0] if leaf(module) in ("k_proj", "v_proj") else module
            for kind in (("k", "v") if leafname == "kv_scale" else (leafname[0],)):
                self.attention_scales[f"{attn}.{kind}_scale"] = value.max().item()
        if unused:
            self.warn(f"{len(unused)} attention scale tensor(s) for fp8 attention math (e.g. {unused[0]}) are "
                             "not used: attention runs in 16 bits")

    def _check_plain(self, plain: list[str]) -> None:
        """Every plain tensor (and each part of a merged linear's bias) is a float, of the shape config.json implies
        where it implies one: an integer one was copied into a float parameter, a merged bias of the wrong length
        was refused without naming its part."""
        for name in plain:
            meta = self.index.meta[name]
            expected = self._plain_shape(name)
            if expected and tuple(meta.shape) != expected:
                raise CheckpointError(f"wrong shape {list(meta.shape)}, expected {list(expected)}",
                                      file=meta.file, tensor=name)
            if meta.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"wrong dtype {meta.dtype_name}, expected a 16/32-bit "
                                      "float", file=meta.file, tensor=name)

    def _plain_shape(self, name: str) -> tuple[int, ...] | None:
        hidden, vocab = self.config.get("hidden_size"), self.config.get("vocab_size")
        if name.endswith("norm.weight") and ("layernorm" in name or name == "model.norm.weight") and hidden:
            return (hidden,)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and hidden and vocab:
            return (vocab, hidden)
        if name.endswith(".bias"):  # a projection's: one value per output row
            shape = self._expected(name.removesuffix(".bias"))
            return shape[:1] if shape else None
        return None

    def _check_complete(self, linears: list[_Linear], plain: list[str]) -> None:
        """Llama/Qwen-style decoders: every layer must have all its linears and norms (decoder_tensors)."""
        if not self._shapes or not any(n.startswith("model.layers.") for n in self.index.meta):
            return
        have = {e.canonical for e in linears} | set(plain)
        have |= {name for group in self._stacked.values() for name in group.linear_names()}
        missing = first_missing(needed_decoder_tensors(self.config, self.architecture, self.tie_word_embeddings),
                                have, self.architecture)
        if missing is not None and missing.endswith(".weight") and is_linear_module(missing[:-len(".weight")]):
            module = missing[:-len(".weight")]  # named as quantization_config stores it: NVFP4's weight_packed, ...
            scheme = self.quant.scheme_for(module, linear=True)
            missing = required_tensors(module, scheme.format, scheme.layout)[0]
        if missing is not None:
            raise CheckpointError("tensor missing from the checkpoint", file=self.path, tensor=missing)

    # ------------------------------------------------------------------ interface

    def stored_name(self, name: str) -> str:
        """A merged linear's bias (qkv_proj.bias) by the first part's name the checkpoint holds (q_proj.bias)."""
        if name in self.index.meta or not name.endswith(".bias"):
            return name
        parts = [f"{m}.bias" for m in partition_modules(name.removesuffix(".bias"))]
        return next((p for p in parts if p in self.index.meta), name)

    def file_of(self, name: str) -> str:
        """The shard holding tensor `name`; for a linear (a projection or a merged qkv_proj / gate_up_proj, in
        any stored format) the shard holding all its tensors; the directory when they lie in several shards."""
        meta = self.index.meta.get(name) or self.index.meta.get(self.stored_name(name))  # a merged bias: its part's
        if meta is not None:
            return meta.file
        files = {self.index.meta[t].file for t in self._tensors_of_linear(name.removesuffix(".weight"))}
        return files.pop() if len(files) == 1 else self.path

    def _tensors_of_linear(self, module: str) -> list[str]:
        for group in self._stacked.values():  # gpt-oss: every expert of a layer in the same few tensors
            if module.startswith(f"{group.prefix}."):
                return group.tensor_names()
        return [t for m in dict.fromkeys((*partition_modules(module), module)) for t in self._module_tensors.get(m, ())]

    def describe(self) -> list[EntryInfo]:
        out = []
        for e in self._linears:
            tensors = [n for m in e.modules for n in self._module_tensors.get(m, ()) if not n.endswith(".bias")]
            shapes = [self._stored_shape(m) for m in e.modules]
            fmt = e.formats[0] if len(set(e.formats)) == 1 else "dense"
            name = "lm_head.weight" if e.canonical == "lm_head" and fmt == "dense" else e.canonical
            if name == "lm_head.weight":
                fmt = str(self.index.meta[name].dtype).replace("torch.", "")
            out.append(EntryInfo(name, name != "lm_head.weight", fmt, (sum(s[0] for s in shapes), shapes[0][1]),
                                 tuple(s[0] for s in shapes), sum(self.index.meta[t].nbytes for t in tensors)))
        for name in self._plain:
            meta = self.index.meta[name]
            out.append(EntryInfo(name, False, str(meta.dtype).replace("torch.", ""), meta.shape, (), meta.nbytes))
        for name, parts in self._biases.items():
            metas = [self.index.meta[parts[i]] for i in sorted(parts)]
            out.append(EntryInfo(name, False, str(metas[0].dtype).replace("torch.", ""),
                                 (sum(m.shape[0] for m in metas),), (), sum(m.nbytes for m in metas)))
        for group in self._stacked.values():
            out += self._describe_stacked(group)
        return sorted(out, key=lambda e: sort_key(e.name))

    def _describe_stacked(self, group) -> list[EntryInfo]:
        """One entry per expert linear and bias of a stacked group (bytes split evenly over the experts)."""
        out = []
        for proj in ("gate_up_proj", "down_proj"):
            metas = [self.index.meta[n] for n in group.tensor_names() if f".{proj}" in n and not n.endswith("_bias")]
            if group.format == "mxfp4":
                rows, k = metas[0].shape[1], metas[0].shape[2] * metas[0].shape[3] * 2
            else:  # stored input-major
                k, rows = metas[0].shape[1], metas[0].shape[2]
            parts = (rows // 2, rows // 2) if proj == "gate_up_proj" else (rows,)
            bias = self.index.meta[f"{group.prefix}.{proj}_bias"] if group.biased else None
            for e in range(group.num_experts):
                name = f"{group.prefix}.{e}.{proj}"
                out.append(EntryInfo(name, True, group.format, (rows, k), parts,
                                     sum(m.nbytes for m in metas) // group.num_experts))
                if bias is not None:
                    out.append(EntryInfo(f"{name}.bias", False, str(bias.dtype).replace("torch.", ""), (rows,), (),
                                         bias.nbytes // group.num_experts))
        return out

    def _stored_shape(self, module: str) -> tuple[int, int]:
        main = self.index.meta.get(f"{module}.weight_packed") or self.index.meta[f"{module}.weight"]
        n, k = main.shape[0], main.shape[-1]
        return (n, k * 2) if main.dtype == torch.uint8 else (n, k)

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, object]]:
        for read in self.weight_reads(progress):
            yield from read()

    def weight_reads(self, progress: bool = True) -> Iterator[Callable[[], Iterator[tuple[str, object]]]]:
        """iter_weights one entry at a time: a function per entry (a linear, a plain tensor, a merged bias, a layer's
        stacked experts) that reads it, yielding its (canonical name, Weight | torch.Tensor). A fault one entry's
        read raises (a scale the reader refuses) leaves the rest readable: inspect --values records it and reads on."""
        items = [("linear", e) for e in self._linears] + [("plain", n) for n in self._plain] \
            + [("bias", n) for n in self._biases] + [("stacked", p) for p in self._stacked]
        items.sort(key=lambda item: sort_key(item[1].canonical if item[0] == "linear" else item[1]))
        for what, item in tqdm(items, desc=f"reading {os.path.basename(self.path)}", unit="tensor",
                               disable=not progress, leave=False):
            yield functools.partial(self._read_entry, what, item)

    def _read_entry(self, what: str, item) -> Iterator[tuple[str, object]]:
        if what == "stacked":
            yield from read_stacked_experts(self._stacked[item], self.index)
        elif what == "plain":
            yield item, self.index.get(item)
        elif what == "bias":
            parts = self._biases[item]
            yield item, torch.cat([self.index.get(parts[i]) for i in sorted(parts)])
        else:
            weight = self._read_linear(item)
            if item.canonical == "lm_head" and weight.format == "dense":
                yield "lm_head.weight", weight.tensor
            else:
                yield item.canonical, weight

    def _read_linear(self, entry: _Linear):
        weights = [read_linear(m, f, self.index, self._expected(m), scheme)
                   for m, f, scheme in zip(entry.modules, entry.formats, entry.schemes)]
        if len(weights) == 1:
            return weights[0]
        if len(set(entry.formats)) > 1:
            # partitions stored in different formats cannot share one kernel: their values, in float32 (exact; the
            # loader casts them to the serving dtype), said at open (_warn_mixed_partitions)
            return concat_partitions([DenseWeight(dequantize(w).float()) for w in weights])
        return concat_partitions(weights)

    @property
    def has_tokenizer(self) -> bool:
        return has_tokenizer_files(self.path)

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def chat_template(self) -> str | None:
        templates = self.chat_templates
        return templates.get("default") or next(iter(templates.values()), None)

    @property
    def chat_templates(self) -> dict[str, str]:
        from radiance.server.chat_template import note_source

        files = chat_template_files(self.path)
        for text, path in files.values():  # a parse error, met when first rendered (generate, serve), names its file
            note_source(text, f"file {path}")
        return {name: text for name, (text, _) in files.items()}

    def template_source(self, template: str) -> str:
        """Where `template` (one of chat_templates) was read from: "file PATH"."""
        return next((f"file {path}" for text, path in chat_template_files(self.path).values() if text == template),
                    f"file {self.path}")

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

