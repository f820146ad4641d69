"""The corruptions the checkpoint fuzz (test_checkpoint_fuzz.py) applies: each kind breaks a copied checkpoint one
way, drawing its details from `rng`, and says what a refusal must name (a Fault), or None where nothing is wrong."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import gguf
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint.surgery import GgufLayout, Safetensors, first_tensor_cut, header_length, poke

GGUF_TYPES = {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_0,  # the int4 and dequantized paths too
              "blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q4_1}


@dataclass(frozen=True)
class Fault:
    """What a refusal must name: the file at fault and, where one tensor is, that tensor."""

    file: str
    tensor: str | None = None
    # config.json disagreeing with the tensors: naming the tensor that does not fit (and its file) names it too
    or_a_tensor_under: str | None = None

    def named_by(self, message: str) -> bool:
        if self.or_a_tensor_under is not None and self.or_a_tensor_under in message and ", tensor " in message:
            return True
        return self.file in message and (self.tensor is None or f"tensor {self.tensor}" in message)


# ---------------------------------------------------------------------- safetensors files, byte by byte


def _files(root: str) -> list[str]:
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))


def truncate(root: str, rng: random.Random) -> Fault:
    """Cut inside the header's length, inside the header, or inside a tensor's data."""
    file = rng.choice(_files(root))
    size, header_end = os.path.getsize(file), 8 + header_length(file)
    kept = rng.choice([rng.randrange(0, 8), rng.randrange(8, header_end), rng.randrange(header_end, size)])
    tensor = first_tensor_cut(file, kept) if kept >= header_end else None
    os.truncate(file, kept)
    return Fault(file, tensor)


def header_length_field(root: str, rng: random.Random) -> Fault:
    """The 8-byte header length: past the file, "negative" (top bit set), zero, into the data, short of the JSON."""
    file = rng.choice(_files(root))
    size, length = os.path.getsize(file), header_length(file)
    value = rng.choice([size, size + 1, 2**64 - 1, 2**63, 0, length + 8, length - 1, 7])
    poke(file, 0, value.to_bytes(8, "little"))
    return Fault(file)


def header_garbage(root: str, rng: random.Random) -> Fault:
    """A few bytes of the header JSON replaced by characters that break it or rename what they hit."""
    file = rng.choice(_files(root))
    for _ in range(rng.randint(1, 3)):
        poke(file, 8 + rng.randrange(header_length(file)), bytes([rng.choice(b'#{}[]",:\x00\xff-')]))
    return Fault(file)


def header_not_an_object(root: str, rng: random.Random) -> Fault:
    file = rng.choice(_files(root))
    st = Safetensors.read(file)
    st.write(file, header_text=rng.choice([b"[1, 2]", b"null", b'"model"', b"3", b"{}", b'{"a": 1}']))
    return Fault(file)


def _entry_fault(edit):
    """A kind that rewrites one tensor's header entry with `edit(entry, st, rng)`."""
    def kind(root: str, rng: random.Random) -> Fault:
        file = rng.choice(_files(root))
        st = Safetensors.read(file)
        name = rng.choice(st.tensors())
        replaced = edit(st.header[name], st, rng)
        if replaced is not None:
            st.header[name] = replaced
        st.write(file)
        return Fault(file, name)
    kind.__name__ = edit.__name__
    return kind


@_entry_fault
def offsets_out_of_range(entry, st, rng):
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = rng.choice([[begin, len(st.data) + 16], [len(st.data) + 8, len(st.data) + 8 + end - begin],
                                        [-2, end - begin - 2]])


@_entry_fault
def offsets_reversed(entry, st, rng):
    entry["data_offsets"] = entry["data_offsets"][::-1]


@_entry_fault
def offsets_overlapping(entry, st, rng):
    """Onto the bytes of another tensor (shifted by a few bytes), leaving its own uncovered."""
    begin, end = entry["data_offsets"]
    shift = rng.choice([-2, 2, -(end - begin) // 2]) if begin else rng.choice([2, (end - begin) // 2])
    entry["data_offsets"] = [begin + shift, end + shift]


@_entry_fault
def offsets_not_integers(entry, st, rng):
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = rng.choice([["0", end], [begin + 0.5, end], None, [begin], [begin, end, end], {}])


@_entry_fault
def dtype_unknown(entry, st, rng):
    entry["dtype"] = rng.choice(["Q4", "bf16", "", 7, None, "F8_E4M3FNUZ", "F4"])


@_entry_fault
def shape_not_matching_bytes(entry, st, rng):
    shape = entry["shape"]
    entry["shape"] = rng.choice([[d * 2 for d in shape], shape + [2], [], [-1] + shape[1:], "64", [1.5]])


@_entry_fault
def entry_not_an_object(entry, st, rng):
    return rng.choice([5, [], "x", {"dtype": entry["dtype"]}])



# ---------------------------------------------------------------------- tensors: missing, extra, reshaped, recast


def _where(root: str) -> dict[str, str]:
    """tensor -> the file holding it."""
    return {name: file for file in _files(root) for name in Safetensors.read(file).tensors()}


def rewrite(file: str, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def missing_tensor(root: str, rng: random.Random) -> Fault:
    where = _where(root)
    name = rng.choice(sorted(where))
    rewrite(where[name], lambda t: t.pop(name))
    return Fault(root, name)


# names a checkpoint may carry beside the model's: some the model has no place for, some it may skip
EXTRA_NAMES = ["model.layers.0.mlp.extra_proj.weight", "model.extra.weight", "model.layers.7.self_attn.q_proj.weight",
               "model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.bias", "visual.blocks.0.weight",
               "model.layers.0.self_attn.q_proj.input_scale", "model.layers.1.mlp.down_proj.weight_zero_point",
               "model.layers.0.self_attn.q_proj.weight_scale_3", "model.norm.bias"]


def extra_tensor(root: str, rng: random.Random) -> Fault:
    name, file = rng.choice(EXTRA_NAMES), rng.choice(_files(root))
    if name in _where(root):
        name = "model.layers.0.mlp.extra_proj.weight"
    rewrite(file, lambda t: t.__setitem__(name, torch.ones(8, 64, dtype=torch.bfloat16)))
    return Fault(file, name)


def wrong_shape(root: str, rng: random.Random) -> Fault:
    """Transposed where that changes the shape, else a row (or element) short or one too many."""
    where = _where(root)
    name = rng.choice(sorted(where))

    def reshape(t):
        x = t[name].reshape(-1) if t[name].dim() == 0 else t[name]  # a scalar becomes [1], then [2]
        if x.dim() == 2 and x.shape[0] != x.shape[1] and rng.random() < 0.5:
            t[name] = x.t().contiguous()
        elif rng.random() < 0.5 and x.shape[0] > 1:
            t[name] = x[:-1].contiguous()
        else:
            t[name] = torch.cat([x, x[:1]])
    rewrite(where[name], reshape)
    return Fault(where[name], name)


def _other_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """Dtypes no reader should take where `dtype` was written (a 16-bit float for an fp8 scale is fine)."""
    if dtype == torch.uint8:
        return [torch.int8, torch.int32, torch.float16, torch.bool]
    if dtype == torch.float8_e4m3fn:
        return [torch.uint8, torch.int8, torch.float8_e5m2]
    return [torch.int8, torch.int32, torch.uint8, torch.float64, torch.float8_e5m2, torch.bool]


def wrong_dtype(root: str, rng: random.Random) -> Fault:
    where = _where(root)
    name = rng.choice(sorted(where))

    def recast(t):
        t[name] = t[name].to(rng.choice(_other_dtypes(t[name].dtype)))
    rewrite(where[name], recast)
    return Fault(where[name], name)


def scale_wrong_dtype(root: str, rng: random.Random) -> Fault:
    """A scale tensor (block, global, second-level, stacked experts') in a dtype its format does not use."""
    where = _where(root)
    name = rng.choice(sorted(n for n in where if n.endswith(("_scale", "_scales", "_scale_inv", "_scale_2"))))

    def recast(t):
        t[name] = t[name].to(rng.choice(_other_dtypes(t[name].dtype)))
    rewrite(where[name], recast)
    return Fault(where[name], name)


def widened(root: str, rng: random.Random) -> Fault | None:
    """A 16-bit tensor stored as float32 (the same values): nothing is wrong, the model must answer the same."""
    where = _where(root)
    name = rng.choice(sorted(n for n, file in where.items() if _dtype(file, n) in ("BF16", "F16")))
    rewrite(where[name], lambda t: t.__setitem__(name, t[name].float()))
    return None


def _dtype(file: str, name: str) -> str:
    return Safetensors.read(file).header[name]["dtype"]


def nan_in_weights(root: str, rng: random.Random) -> Fault:
    """One value NaN: a float's NaN, e4m3's 0x7F, e8m0's 0xFF (packed e2m1 codes have none)."""
    where = _where(root)
    candidates = sorted(n for n, file in where.items() if _dtype(file, n) != "U8" or n.endswith(("_scale", "_scales")))
    name = rng.choice(candidates)

    def poison(t):
        x = t[name].clone()
        flat = x.view(-1) if x.dtype != torch.float8_e4m3fn else x.view(torch.uint8).view(-1)
        index = rng.randrange(flat.numel())
        flat[index] = 0xFF if x.dtype == torch.uint8 else 0x7F if x.dtype == torch.float8_e4m3fn else float("nan")
        t[name] = x
    rewrite(where[name], poison)
    return Fault(where[name], name)


# ---------------------------------------------------------------------- the shard index


def _index(root: str):
    path = os.path.join(root, "model.safetensors.index.json")
    with open(path) as handle:
        return path, json.load(handle)


def save_json(path: str, data) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle)


def index_names_a_missing_shard(root: str, rng: random.Random) -> Fault:
    path, index = _index(root)
    name = rng.choice(sorted(index["weight_map"]))
    index["weight_map"][name] = "model-00009-of-00002.safetensors"
    save_json(path, index)
    return Fault(os.path.join(root, "model-00009-of-00002.safetensors"))


def index_names_the_wrong_shard(root: str, rng: random.Random) -> Fault:
    path, index = _index(root)
    name = rng.choice(sorted(index["weight_map"]))
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(s for s in shards if s != index["weight_map"][name])
    save_json(path, index)
    return Fault(root, name)


def index_names_an_unknown_tensor(root: str, rng: random.Random) -> Fault:
    path, index = _index(root)
    name = rng.choice(EXTRA_NAMES)
    index["weight_map"][name] = rng.choice(sorted(set(index["weight_map"].values())))
    save_json(path, index)
    return Fault(root, name)


def index_forgets_a_tensor(root: str, rng: random.Random) -> Fault:
    path, index = _index(root)
    name = rng.choice(sorted(index["weight_map"]))
    del index["weight_map"][name]
    save_json(path, index)
    return Fault(root, name)


def index_garbage(root: str, rng: random.Random) -> Fault:
    path, index = _index(root)
    text = json.dumps(index)
    _save_text(path, rng.choice([text[:rng.randrange(len(text))], "[]", json.dumps({"weight_map": []}),
                                 json.dumps({"weight_map": {"model.norm.weight": None}})]))
    return Fault(path)


def _save_text(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


# ---------------------------------------------------------------------- config.json


def read_config(root: str):
    path = os.path.join(root, "config.json")
    with open(path) as handle:
        return path, json.load(handle)


def config_missing_field(root: str, rng: random.Random) -> Fault:
    path, config = read_config(root)
    # rms_norm_eps left out means transformers' 1e-6, not the 1e-5 written: another model, rightly served
    del config[rng.choice(sorted(k for k in config if k not in ("quantization_config", "rms_norm_eps")))]
    save_json(path, config)
    return Fault(path, or_a_tensor_under=root)


def _wrong_values(value) -> list:
    """Values of another type than `value`'s (or out of its range), none of which means a valid model."""
    if isinstance(value, bool):
        return ["false", 1, [], {}]
    if isinstance(value, int):
        return [str(value), value + 0.5, [value], -value, 0, True, {}]
    if isinstance(value, float):
        return [str(value), [value], -value, True, {}]
    if isinstance(value, str):
        return [7, [], {}, "nonsense"]
    return [7, "x", {}, [7]]


def config_wrong_type(root: str, rng: random.Random) -> Fault:
    path, config = read_config(root)
    key = rng.choice(sorted(k for k in config if k not in ("quantization_config", "layer_types")))
    config[key] = rng.choice(_wrong_values(config[key]))
    save_json(path, config)
    return Fault(path, or_a_tensor_under=root)


def config_heads_disagree(root: str, rng: random.Random) -> Fault:
    path, config = read_config(root)
    config.update(rng.choice([{"num_attention_heads": 3}, {"num_key_value_heads": 3}, {"num_key_value_heads": 8},
                              {"head_dim": 8}, {"num_attention_heads": 8}, {"hidden_size": 48},
                              {"num_attention_heads": 2, "num_key_value_heads": 4}]))
    save_json(path, config)
    return Fault(path, or_a_tensor_under=root)


def config_garbage(root: str, rng: random.Random) -> Fault:
    path, config = read_config(root)
    text = json.dumps(config)
    _save_text(path, rng.choice([text[:rng.randrange(len(text))], "[]", "null", "\x00\xff", ""]))
    return Fault(path)


def _paths(tree, prefix=()):
    """Every (key path) inside a JSON tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from _paths(value, prefix + (key,))


def quantization_config_garbage(root: str, rng: random.Random) -> Fault:
    path, config = read_config(root)
    qc = config["quantization_config"]
    *parents, leaf = rng.choice(sorted(_paths(qc), key=str))
    node = qc
    for key in parents:
        node = node[key]
    node[leaf] = rng.choice([7, "x", [], {}, None, -1, [7], {"x": 1}])
    save_json(path, config)
    return Fault(path)


# ---------------------------------------------------------------------- GGUF


def gguf_magic(path: str, rng: random.Random) -> Fault:
    poke(path, 0, rng.choice([b"GGUG", b"FUGG", b"\x00\x00\x00\x00", b"PK\x03\x04"]))
    return Fault(path)


def gguf_version(path: str, rng: random.Random) -> Fault:
    poke(path, 4, rng.choice([0, 1, 4, 2**32 - 1, 0x03000000]).to_bytes(4, "little"))
    return Fault(path)


def gguf_truncate(path: str, rng: random.Random) -> Fault:
    """Cut inside the header or inside the tensor data."""
    layout = GgufLayout.read(path)
    os.truncate(path, rng.choice([rng.randrange(0, layout.data_start), rng.randrange(layout.data_start, layout.size)]))
    return Fault(path)


def gguf_metadata_type(path: str, rng: random.Random) -> Fault:
    """A metadata value type no GGUF version has (13 and up)."""
    layout = GgufLayout.read(path)
    key = rng.choice(sorted(layout.kv_type_at))
    poke(path, layout.kv_type_at[key], rng.choice([13, 99, 2**31, 2**32 - 1]).to_bytes(4, "little"))
    return Fault(path)


def gguf_tensor_type(path: str, rng: random.Random) -> Fault:
    layout = GgufLayout.read(path)
    t = rng.choice(layout.tensors)
    poke(path, t.type_at, rng.choice([4, 5, 99, 1000, 2**31]).to_bytes(4, "little"))
    return Fault(path, t.name)


def gguf_tensor_dims(path: str, rng: random.Random) -> Fault:
    layout = GgufLayout.read(path)
    t = rng.choice(layout.tensors)
    if rng.random() < 0.5:
        poke(path, t.n_dims_at, rng.choice([0, 5, 2**31]).to_bytes(4, "little"))
        return Fault(path)
    dim = rng.randrange(len(t.dims))
    poke(path, t.n_dims_at + 4 + 8 * dim, rng.choice([0, 1, 2**40, 2**63 + 32]).to_bytes(8, "little"))
    return Fault(path)


def gguf_nan(path: str, rng: random.Random) -> Fault:
    layout = GgufLayout.read(path)
    t = rng.choice([t for t in layout.tensors if t.type_id == gguf.GGMLQuantizationType.F32])
    layout.set_nan(path, t.name, rng.randrange(int(torch.tensor(t.dims).prod())))
    return Fault(path, t.name)


def gguf_metadata_values(path: str, rng: random.Random) -> Fault:
    """Sizes that disagree with the tensors, or mean no model."""
    from tests.checkpoint.test_gguf_metadata import write_gguf

    overrides = rng.choice([{"llama.embedding_length": 65}, {"llama.attention.head_count": 3},
                            {"llama.attention.head_count_kv": 0}, {"llama.block_count": 2},
                            {"llama.feed_forward_length": 100}, {"llama.context_length": 0},
                            {"llama.attention.head_count": 8}])
    write_gguf(path, types=GGUF_TYPES, overrides=overrides)
    return Fault(path)
