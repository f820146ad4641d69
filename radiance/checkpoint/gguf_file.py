"""A GGUF file's metadata and tensor table, read in one pass with `struct` over a memory map.

gguf-py's GGUFReader builds a numpy view per metadata element: about 6 s for the embedded SmolLM2's
49k-token vocabulary and 49k merges, half of a cold start. The container is a flat run of little-endian
scalars and length-prefixed strings (ggml's docs/gguf.md), so one `struct` pass reads it in ~0.1 s;
gguf-py still supplies the type tables (value types, quantization block sizes) and the dequantizers.
Only little-endian files of version 2 or 3 (every file llama.cpp writes on x86 and ARM since 2023) are
read; like llama.cpp, a duplicated metadata key or tensor name and an alignment that is not a power of two
are refused.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import gguf
import numpy as np

from radiance.checkpoint.hf_config import unreadable_file
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
                size = count * struct.calcsize("<" + _SCALARS[item_type])  # before building a format of `count`
                if self.pos + size > len(self.buf):
                    raise CheckpointError("truncated GGUF header (an array runs past the end of the file)",
                                          file=self.path)
                items = list(struct.unpack_from(f"<{count}{_SCALARS[item_type]}", self.buf, self.pos))
                self.pos += size
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise CheckpointError(f"unknown GGUF metadata value type {value_type}", file=self.path)
        return self.scalar(_SCALARS[value_type])


def _check_version(version: int, path: str) -> None:
    """Versions 2 and 3, little-endian; a big-endian file shows its version byte-swapped."""
    if version in _VERSIONS:
        return
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    if swapped in _VERSIONS + (1,):
        raise CheckpointError(f"big-endian GGUF (version {swapped}): radiance reads little-endian GGUF files; "
                              "convert the model again with llama.cpp's default byte order", file=path)
    if version == 1:  # 32-bit counts and lengths: a layout of its own, replaced in 2023
        raise CheckpointError("GGUF version 1 is not supported (radiance reads versions 2 and 3): convert the "
                              "model again with a current llama.cpp", file=path)
    raise CheckpointError(f"GGUF version {version} is not supported (radiance reads versions 2 and 3)", file=path)


class GgufFile:
    """`metadata` {key: str | int | float | bool | list}, `tensors` [GgufTensor] in file order."""

    def __init__(self, path: str):
        self.path = path
        unreadable = unreadable_file(path)
        if unreadable:
            raise CheckpointError(f"unreadable GGUF file: {unreadable}", file=path)
        try:
            blob = np.memmap(path, mode="r")
        except (OSError, ValueError) as exc:  # a missing file, or an empty one (mmap of length 0)
            raise CheckpointError(f"unreadable GGUF file: {exc}", file=path) from None
        cur = _Cursor(blob, path)
        if len(blob) < 4 or cur.scalar("I") != gguf.GGUF_MAGIC:
            raise CheckpointError("not a GGUF file (no GGUF magic)", file=path)
        _check_version(cur.scalar("I"), path)
        tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = cur.string()
            if key in self.metadata:  # which value is meant? llama.cpp refuses the file too
                raise CheckpointError(f"GGUF metadata key {key} appears twice", file=path)
            self.metadata[key] = cur.value(cur.scalar("I"))
        table, names = [], set()
        for _ in range(tensor_count):
            name = cur.string()
            if name in names:  # the second would silently replace the first
                raise CheckpointError("GGUF tensor name appears twice", file=path, tensor=name)
            names.add(name)
            dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
            table.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        alignment = self._alignment()
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(blob, data_start, *entry) for entry in table]
        self._check_layout(table, alignment)

    def _check_layout(self, table: list[tuple], alignment: int) -> None:
        """llama.cpp's rule: each tensor's data follows the previous one's, padded to the alignment. A moved offset
        (misaligned, or onto another tensor's bytes) was read as it stood."""
        expected = 0
        for (name, _, _, offset), tensor in zip(table, self.tensors):
            if offset != expected:
                raise CheckpointError(f"GGUF tensor data at offset {offset}, expected {expected} (each tensor "
                                      f"follows the previous one, padded to general.alignment {alignment}): a "
                                      "corrupt file", file=self.path, tensor=name)
            expected += -(-tensor.n_bytes // alignment) * alignment

    def _alignment(self) -> int:
        """general.alignment: the tensor data's alignment, a power of two (0 was a ZeroDivisionError)."""
        value = self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
            raise CheckpointError(f"GGUF metadata general.alignment is {value!r}, not a power of two",
                                  file=self.path)
        return value

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
        n_bytes = row_bytes * math.prod(dims[1:])  # exact: a corrupt dimension must not wrap around int64
        start = data_start + offset
        if start + n_bytes > len(blob):
            raise CheckpointError(f"GGUF tensor data ({n_bytes} bytes at {start}) runs past the end of the file "
                                  f"({len(blob)} bytes): truncated download?", file=self.path, tensor=name)
        data = blob[start:start + n_bytes].view(np.ndarray).reshape(*reversed(dims[1:]), row_bytes)
        return GgufTensor(name, qtype, dims, n_bytes, data)
