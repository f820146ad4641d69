"""Byte-level surgery on checkpoint files for the fuzz suite: a safetensors file's header and data, a GGUF file's
field positions. Written independently of radiance's readers (ggml's docs/gguf.md, safetensors' format notes)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import gguf
import numpy as np


# ---------------------------------------------------------------------- safetensors


@dataclass
class Safetensors:
    """A safetensors file split into its header (a dict) and its data area."""

    header: dict
    data: bytes

    @classmethod
    def read(cls, file: str) -> "Safetensors":
        with open(file, "rb") as handle:
            raw = handle.read()
        size = struct.unpack("<Q", raw[:8])[0]
        return cls(json.loads(raw[8:8 + size]), raw[8 + size:])

    def write(self, file: str, header_text: bytes | None = None) -> None:
        """Back to `file`; `header_text` replaces the JSON of the header (garbage welcome)."""
        text = header_text if header_text is not None else json.dumps(self.header).encode()
        text += b" " * (-len(text) % 8)
        with open(file, "wb") as handle:
            handle.write(struct.pack("<Q", len(text)) + text + self.data)

    def tensors(self) -> list[str]:
        """The tensor names, in data order."""
        names = [k for k in self.header if k != "__metadata__"]
        return sorted(names, key=lambda k: self.header[k]["data_offsets"][0])


def header_length(file: str) -> int:
    with open(file, "rb") as handle:
        return struct.unpack("<Q", handle.read(8))[0]


def first_tensor_cut(file: str, kept: int) -> str | None:
    """The first tensor (by where its data ends) whose bytes a file cut to `kept` bytes no longer holds."""
    st = Safetensors.read(file)
    data_kept = kept - 8 - header_length(file)
    if data_kept < 0:
        return None
    ends = sorted((st.header[k]["data_offsets"][1], k) for k in st.tensors())
    return next((name for end, name in ends if end > data_kept), None)


def poke(file: str, position: int, raw: bytes) -> None:
    with open(file, "r+b") as handle:
        handle.seek(position)
        handle.write(raw)


# ---------------------------------------------------------------------- GGUF

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


@dataclass
class GgufTensorAt:
    name: str
    n_dims_at: int  # byte position of its dimension count
    type_at: int
    type_id: int
    offset_at: int
    offset: int  # its data's offset from the data area's start
    dims: tuple[int, ...]


@dataclass
class GgufLayout:
    """Where each field of a GGUF file lies (little-endian, version 2 or 3)."""

    size: int
    kv_type_at: dict[str, int] = field(default_factory=dict)  # key -> byte position of its value type
    tensors: list[GgufTensorAt] = field(default_factory=list)
    data_start: int = 0

    @classmethod
    def read(cls, path: str) -> "GgufLayout":
        raw = open(path, "rb").read()
        pos = 8  # magic, version
        n_tensors, n_kv = struct.unpack_from("<QQ", raw, pos)
        pos += 16
        out = cls(len(raw))

        def string(pos: int) -> tuple[str, int]:
            size = struct.unpack_from("<Q", raw, pos)[0]
            return raw[pos + 8:pos + 8 + size].decode(), pos + 8 + size

        def skip_value(value_type: int, pos: int) -> int:
            if value_type == _STRING:
                return string(pos)[1]
            if value_type == _ARRAY:
                item_type, count = struct.unpack_from("<IQ", raw, pos)
                pos += 12
                for _ in range(count):
                    pos = skip_value(item_type, pos)
                return pos
            return pos + _SCALAR_SIZES[value_type]

        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, pos = string(pos)
            out.kv_type_at[key] = pos
            value_type = struct.unpack_from("<I", raw, pos)[0]
            if key == "general.alignment":
                alignment = struct.unpack_from("<I", raw, pos + 4)[0]
            pos = skip_value(value_type, pos + 4)
        for _ in range(n_tensors):
            name, pos = string(pos)
            n_dims_at = pos
            n_dims = struct.unpack_from("<I", raw, pos)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", raw, pos + 4)
            pos += 4 + 8 * n_dims
            type_id, offset = struct.unpack_from("<IQ", raw, pos)
            out.tensors.append(GgufTensorAt(name, n_dims_at, pos, type_id, pos + 4, offset, tuple(dims)))
            pos += 12
        out.data_start = -(-pos // alignment) * alignment
        return out

    def tensor(self, name: str) -> GgufTensorAt:
        return next(t for t in self.tensors if t.name == name)

    def set_nan(self, path: str, name: str, index: int) -> None:
        """Element `index` of F32 tensor `name` becomes NaN."""
        t = self.tensor(name)
        assert t.type_id == gguf.GGMLQuantizationType.F32
        poke(path, self.data_start + t.offset + 4 * index, np.float32(np.nan).tobytes())
