"""A GGUF file's metadata and tensor table, read in one pass with `struct` over a memory map.

gguf-py's GGUFReader builds a numpy view per metadata element: about 6 s for the embedded SmolLM2's
49k-token vocabulary and 49k merges, half of a cold start. The container is a flat run of little-endian
scalars and length-prefixed strings (ggml's docs/gguf.md), so one `struct` pass reads it in ~0.1 s;
gguf-py still supplies the type tables (value types, quantization block sizes) and the dequantizers.
Only little-endian files (every file llama.cpp writes on x86 and ARM) are read.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import gguf
import numpy as np

from radiance.errors import CheckpointError

_SCALARS = {  # GGUFValueType -> struct format
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}
_VERSIONS = (2, 3)


class GgufTensor(NamedTuple):
    """One tensor of the table, shaped as gguf-py's ReaderTensor: `shape` fastest-moving dimension first,
    `data` its bytes as uint8 [rows..., bytes per row] (a view of the file), what gguf.quants.dequantize takes."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray


class _Cursor:
    """Sequential little-endian reads over the mapped file; running past its end is a CheckpointError."""

    def __init__(self, blob: np.ndarray, path: str):
        self.buf, self.pos, self.path = memoryview(blob), 0, path

    def scalar(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise CheckpointError("truncated GGUF header", file=self.path)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        if self.pos + size > len(self.buf):
            raise CheckpointError("truncated GGUF header (a string runs past the end of the file)", file=self.path)
        raw = bytes(self.buf[self.pos:self.pos + size])
        self.pos += size
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type == gguf.GGUFValueType.STRING:
            return self.string()
        if value_type == gguf.GGUFValueType.ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:  # numeric arrays in one unpack
                fmt = f"<{count}{_SCALARS[item_type]}"
                if self.pos + struct.calcsize(fmt) > len(self.buf):
                    raise CheckpointError("truncated GGUF header (an array runs past the end of the file)",
                                          file=self.path)
                items = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise CheckpointError(f"unknown GGUF metadata value type {value_type}", file=self.path)
        return self.scalar(_SCALARS[value_type])


class GgufFile:
    """`metadata` {key: str | int | float | bool | list}, `tensors` [GgufTensor] in file order."""

    def __init__(self, path: str):
        self.path = path
        try:
            blob = np.memmap(path, mode="r")
        except (OSError, ValueError) as exc:  # a missing file, or an empty one (mmap of length 0)
            raise CheckpointError(f"unreadable GGUF file: {exc}", file=path) from None
        cur = _Cursor(blob, path)
        if len(blob) < 4 or cur.scalar("I") != gguf.GGUF_MAGIC:
            raise CheckpointError("not a GGUF file (no GGUF magic)", file=path)
        version = cur.scalar("I")
        if version not in _VERSIONS:
            raise CheckpointError(f"GGUF version {version} is not supported (only {_VERSIONS}, little-endian)",
                                  file=path)
        tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        table = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
            table.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(blob, data_start, *entry) for entry in table]

    def _tensor(self, blob: np.ndarray, data_start: int, name: str, dims: tuple[int, ...], type_id: int,
                offset: int) -> GgufTensor:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise CheckpointError(f"unknown GGUF tensor type {type_id}", file=self.path, tensor=name) from None
        if not dims or dims[0] % block:
            raise CheckpointError(f"GGUF tensor shape {dims} does not fit {qtype.name} blocks of {block}",
                                  file=self.path, tensor=name)
        row_bytes = dims[0] // block * block_bytes
        n_bytes = row_bytes * int(np.prod(dims[1:], dtype=np.int64))
        start = data_start + offset
        if start + n_bytes > len(blob):
            raise CheckpointError(f"GGUF tensor data ({n_bytes} bytes at {start}) runs past the end of the file "
                                  f"({len(blob)} bytes): truncated download?", file=self.path, tensor=name)
        data = blob[start:start + n_bytes].view(np.ndarray).reshape(*reversed(dims[1:]), row_bytes)
        return GgufTensor(name, qtype, dims, n_bytes, data)
