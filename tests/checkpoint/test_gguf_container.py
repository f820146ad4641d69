"""GGUF container faults gguf-py's writer cannot produce, written byte by byte: byte order, old versions,
duplicated keys and tensor names, a bad general.alignment, corrupt counts and dimensions."""

import struct

import gguf
import numpy as np
import pytest

from radiance.checkpoint.gguf_file import GgufFile
from radiance.errors import CheckpointError

V = gguf.GGUFValueType


def _string(text: str, order: str = "<") -> bytes:
    raw = text.encode()
    return struct.pack(order + "Q", len(raw)) + raw


def raw_gguf(path, kv=(), tensors=(("x", (32, 2), 0),), version=3, order="<", alignment=32) -> str:
    """A GGUF file: `kv` [(key, GGUFValueType, packed value bytes)], `tensors` [(name, dims, offset)] of F32
    zeros, the data area padded to `alignment` (what the reader must find from general.alignment)."""
    head = b"GGUF" + struct.pack(order + "IQQ", version, len(tensors), len(kv))
    for key, value_type, value in kv:
        head += _string(key, order) + struct.pack(order + "I", value_type) + value
    for name, dims, offset in tensors:
        head += _string(name, order) + struct.pack(order + "I", len(dims))
        head += b"".join(struct.pack(order + "Q", d) for d in dims) + struct.pack(order + "IQ", 0, offset)
    head += bytes(-len(head) % alignment)
    size = max((offset + 4 * int(np.prod(dims)) for _, dims, offset in tensors), default=0)
    with open(path, "wb") as handle:
        handle.write(head + bytes(size))
    return str(path)


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def test_the_builder_writes_what_gguf_py_reads(tmp_path):
    path = raw_gguf(tmp_path / "m.gguf", kv=[("general.alignment", V.UINT32, u32(64))], alignment=64,
                    tensors=[("a", (32, 2), 0), ("b", (8,), 256)])
    ours, ref = GgufFile(path), gguf.GGUFReader(path)
    assert ours.metadata["general.alignment"] == 64
    assert [(t.name, t.shape) for t in ours.tensors] == [(t.name, tuple(int(d) for d in t.shape)) for t in ref.tensors]


def test_a_big_endian_file_is_named_as_such(tmp_path):
    """Was: "GGUF version 50331648 is not supported"."""
    path = raw_gguf(tmp_path / "be.gguf", order=">")
    with pytest.raises(CheckpointError, match="big-endian GGUF \\(version 3\\)") as err:
        GgufFile(path)
    assert err.value.file == path and "50331648" not in str(err.value)


def test_version_1_says_to_convert_again(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF version 1 is not supported .*current llama.cpp"):
        GgufFile(raw_gguf(tmp_path / "v1.gguf", version=1))


@pytest.mark.parametrize("value", [0, 48])
def test_an_alignment_that_is_not_a_power_of_two_is_one_line(tmp_path, value):
    """Was: ZeroDivisionError for 0, and tensors read from the wrong offsets for 48."""
    path = raw_gguf(tmp_path / "m.gguf", kv=[("general.alignment", V.UINT32, u32(value))])
    with pytest.raises(CheckpointError, match=f"general.alignment is {value}, not a power of two"):
        GgufFile(path)


def test_a_duplicated_metadata_key_is_refused(tmp_path):
    """Was: the last value silently won (llama.cpp refuses such a file)."""
    kv = [("llama.block_count", V.UINT32, u32(2)), ("llama.block_count", V.UINT32, u32(30))]
    with pytest.raises(CheckpointError, match="metadata key llama.block_count appears twice"):
        GgufFile(raw_gguf(tmp_path / "m.gguf", kv=kv))


def test_a_duplicated_tensor_name_is_refused(tmp_path):
    """Was: the second tensor silently replaced the first in the checkpoint."""
    path = raw_gguf(tmp_path / "m.gguf", tensors=[("blk.0.attn_q.weight", (32, 2), 0),
                                                  ("blk.0.attn_q.weight", (32, 2), 256)])
    with pytest.raises(CheckpointError, match="tensor name appears twice") as err:
        GgufFile(path)
    assert err.value.tensor == "blk.0.attn_q.weight"


def test_a_corrupt_dimension_is_past_the_end_not_a_numpy_error(tmp_path):
    """Was: 2**32 x 2**32 rows wrapped around int64 to a size of 0, then a reshape ValueError."""
    path = raw_gguf(tmp_path / "m.gguf", tensors=[("x", (32, 2, 1), 0)])
    with open(path, "r+b") as handle:  # the second and third dimensions of x: right after its first
        at = handle.read().index(struct.pack("<QQQ", 32, 2, 1)) + 8
        handle.seek(at)
        handle.write(struct.pack("<QQ", 2**32, 2**32))
    with pytest.raises(CheckpointError, match="runs past the end of the file") as err:
        GgufFile(path)
    assert err.value.tensor == "x"


def test_an_array_count_beyond_the_file_is_a_truncated_header(tmp_path):
    kv = [("tokenizer.ggml.scores", V.ARRAY, struct.pack("<IQ", V.FLOAT32, 2**62))]
    with pytest.raises(CheckpointError, match="an array runs past the end of the file"):
        GgufFile(raw_gguf(tmp_path / "m.gguf", kv=kv))
