"""Safetensors files of a model directory: one file, several, or shards with an index.

Tensors are read one at a time through memory-mapped handles, so a model never needs two full copies
in memory. Every failure names the file and the tensor.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from radiance.checkpoint.hf_config import load_json, unreadable_file
from radiance.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"

# safetensors header dtype strings -> torch dtypes
_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


@dataclass(frozen=True)
class TensorMeta:
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype torch cannot hold
    stored_name: str = ""  # the name in the file, where the index renames it ("": the same)
    stored_dtype: str = ""  # the header's dtype string (U16, F8_E8M0, ...)

    @property
    def stored(self) -> str:
        return self.stored_name or self.name

    @property
    def dtype_name(self) -> str:
        """The dtype for messages: torch's name, or the header's where torch has none."""
        return str(self.dtype).replace("torch.", "") if self.dtype is not None else self.stored_dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * (torch.tensor([], dtype=self.dtype).element_size() if self.dtype is not None else 1)


class SafetensorsIndex:
    """Tensor name -> file, shapes and dtypes from the headers; reads tensors on demand.

    `rename` (stored name -> the name the model reads, None to skip the tensor) serves part of a checkpoint
    under other names: a vision-language model's language model as a text-only one (hf_config.language_model);
    the skipped names are kept in `skipped`."""

    def __init__(self, model_dir: str, rename: Callable[[str], str | None] | None = None):
        self.model_dir = model_dir
        self._handles: dict[str, object] = {}
        self.files = self._find_files()
        self.meta: dict[str, TensorMeta] = {}
        self.skipped: list[str] = []
        for path in self.files:
            handle = self._open(path)
            for stored in handle.keys():
                name = rename(stored) if rename is not None else stored
                if name is None:
                    self.skipped.append(stored)
                    continue
                if name in self.meta:
                    raise CheckpointError("tensor stored in two files" if name == stored else
                                          f"tensor stored twice (also as {self.meta[name].stored})", file=path,
                                          tensor=stored)
                piece = handle.get_slice(stored)
                self.meta[name] = TensorMeta(name, path, tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype()),
                                             "" if name == stored else stored, piece.get_dtype())
        self._check_index()

    def _find_files(self) -> list[str]:
        index_path = os.path.join(self.model_dir, INDEX_NAME)
        if os.path.exists(index_path):
            self._weight_map = self._read_index(index_path)
            files = sorted({os.path.join(self.model_dir, f) for f in self._weight_map.values()})
            for path in files:
                if not os.path.exists(path):
                    raise CheckpointError("shard listed in the index is missing", file=path)
            # shards the index leaves out are not read: a tensor only they hold is reported missing (unlisted_note)
            listed = {os.path.normpath(f) for f in files}
            self.unlisted = sorted(f for f in glob.glob(os.path.join(self.model_dir, "*.safetensors"))
                                   if os.path.normpath(f) not in listed)
            return files
        self._weight_map = None
        self.unlisted = []
        files = sorted(glob.glob(os.path.join(self.model_dir, "*.safetensors")))
        if not files:
            has_bin = glob.glob(os.path.join(self.model_dir, "*.bin"))
            hint = " (PyTorch .bin checkpoints are not read; convert them to safetensors)" if has_bin else ""
            raise CheckpointError(f"no .safetensors files in the model directory{hint}", file=self.model_dir)
        return files

    @staticmethod
    def _read_index(path: str) -> dict[str, str]:
        weight_map = load_json(path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError("safetensors index has no weight_map", file=path)
        for name, file in weight_map.items():  # each value is joined to the directory as a file name
            if not isinstance(file, str) or not file:
                raise CheckpointError(f"weight_map must map tensors to file names, got {file!r}", file=path,
                                      tensor=name)
            # a shard of this directory (or below it): a Hub repo's index must not have the server read elsewhere
            if os.path.isabs(file) or os.path.normpath(file).split(os.sep)[0] == os.pardir:
                raise CheckpointError(f"weight_map names {file!r}, a file outside the model directory", file=path,
                                      tensor=name)
        return weight_map

    def unlisted_note(self, exc: CheckpointError) -> CheckpointError:
        """A missing-tensor error with the .safetensors files of the directory the index does not list named (a
        stale or hand-edited index leaves a shard out, and its tensors are not read); `exc` itself where there are
        none, or where it is about something else."""
        if not self.unlisted or not str(exc).startswith(("tensor missing", "tensor listed in the index is missing")):
            return exc
        holding = [f for f in self.unlisted if exc.tensor is None or _holds(f, exc.tensor)]
        if not holding:  # the tensor is in none of them: they are not why it is missing
            return exc
        names = ", ".join(os.path.basename(f) for f in holding)
        which = "which is" if len(holding) == 1 else "which are"
        out = CheckpointError(f"{exc}: the index {INDEX_NAME} does not list {names}, {which} in the directory (its "
                              "tensors are not read: add them to the index's weight_map)")
        out.file, out.tensor = exc.file, exc.tensor
        return out

    def _check_index(self) -> None:
        if self._weight_map is None:
            return
        stored = {meta.stored for meta in self.meta.values()} | set(self.skipped)
        for name, file in self._weight_map.items():
            if name not in stored:
                raise self.unlisted_note(CheckpointError("tensor listed in the index is missing from its shard",
                                                         file=os.path.join(self.model_dir, file), tensor=name))

    def _open(self, path: str):
        handle = self._handles.get(path)
        if handle is None:
            unreadable = unreadable_file(path)
            if unreadable:
                raise CheckpointError(unreadable, file=path)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as exc:  # SafetensorError is not importable under one name across versions
                problem, tensor = _diagnose(path)
                raise CheckpointError(f"unreadable safetensors file (truncated or corrupt?): {problem or exc}",
                                      file=path, tensor=tensor) from None
            self._handles[path] = handle
        return handle

    def names(self) -> list[str]:
        return list(self.meta)

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def get(self, name: str) -> torch.Tensor:
        meta = self.meta.get(name)
        if meta is None:
            raise self.unlisted_note(CheckpointError("tensor missing from the checkpoint", file=self.model_dir,
                                                     tensor=name))
        try:
            return self._open(meta.file).get_tensor(meta.stored)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor: {exc}", file=meta.file, tensor=meta.stored) from None

    def close(self) -> None:
        self._handles.clear()


def _diagnose(path: str) -> tuple[str | None, str | None]:
    """(what is wrong, the tensor at fault) of a file safetensors refused, from its header; (None, None) when
    the header itself is unreadable or looks sound (safetensors' own message then stands).

    safetensors says "file not fully covered", "invalid offset" or "invalid JSON in header: ... at column 3871"
    without naming a tensor (or names it in its own words only), and a truncated download is the usual cause: name
    the first tensor whose bytes the file does not hold, else the first entry that is malformed or misplaced.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                return None, None
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError):
        return None, None
    if not isinstance(header, dict):
        return None, None
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        problem = _entry_structure_problem(entry)
        if problem is not None:
            return problem, name
    data = size - 8 - header_len
    for end, name in sorted((entry["data_offsets"][1], name) for name, entry in entries.items()):
        if end > data:
            return f"the header places this tensor's data up to byte {end}, past the {data} bytes held", name
    return _header_entry_problem(entries) or _layout_problem(entries, data)


# bytes per element of the safetensors dtypes
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_structure_problem(entry) -> str | None:
    """Why a header entry is not {dtype: str, shape: [counts], data_offsets: [begin, end]} with begin <= end."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "the header entry is not {dtype, shape, data_offsets}"
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"the header gives shape {shape!r}, not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        return f"the header gives data_offsets {offsets!r}, not [begin, end] byte positions"
    if offsets[0] > offsets[1]:
        return f"the header gives data_offsets {offsets}: the data ends before it begins"
    return None


def _header_entry_problem(entries: dict) -> tuple[str, str] | None:
    """An entry whose dtype safetensors does not know, or whose shape does not fill its bytes (safetensors says
    "invalid shape, data type, or offset for tensor" without naming it)."""
    for name, entry in entries.items():
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ITEM_BYTES:
            return f"dtype {dtype!r} is not one safetensors reads", name
        if math.prod(shape) * _ITEM_BYTES[dtype] != end - begin:
            return (f"shape {list(shape)} of {dtype} needs {math.prod(shape) * _ITEM_BYTES[dtype]} bytes, the header "
                    f"gives it {end - begin}"), name
    return None


def _layout_problem(entries: dict, data: int) -> tuple[str | None, str | None]:
    """The first tensor whose data does not start where the previous one's ends (an overlap or a gap: safetensors
    keeps the data area packed), or bytes left over after the last one."""
    expected = 0
    for begin, end, name in sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in entries.items()):
        if begin != expected:
            how = "overlaps the previous tensor's" if begin < expected else "leaves a gap after the previous tensor's"
            return f"the header places this tensor's data at byte {begin}, which {how} (ending at {expected})", name
        expected = end
    if expected != data:
        return f"the header's tensors cover {expected} bytes of data, the file holds {data}", None
    return None, None


class ShardWriter:
    """Writes tensors into numbered shards of at most `max_shard_bytes`, then the index."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 << 30):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:  # the later one would silently win (or both land in different shards)
            raise CheckpointError("tensor written twice", file=self.out_dir, tensor=name)
        self._names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        path = os.path.join(self.out_dir, f"_shard_{index:05d}.tmp")
        try:
            save_file(self._pending, path, metadata={"format": "pt"})
        except SafetensorError as exc:  # the library's own error for an I/O failure (no space left, ...)
            raise OSError(f"cannot write a shard: {exc}") from None
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Rename shards to their final names, write the index when there are several; returns file names."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        names = (["model.safetensors"] if count == 1
                 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        weight_map = {}
        for i, (final, tensors) in enumerate(zip(names, self._shards)):
            os.replace(os.path.join(self.out_dir, f"_shard_{i:05d}.tmp"), os.path.join(self.out_dir, final))
            os.chmod(os.path.join(self.out_dir, final), 0o644)  # save_file creates 0600 files
            weight_map.update({t: final for t in tensors})
        if count > 1:
            with open(os.path.join(self.out_dir, INDEX_NAME), "w", encoding="utf-8") as handle:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, handle, indent=2)
        return names


def _holds(path: str, tensor: str) -> bool:
    """Whether the safetensors file at `path` stores `tensor` (its header only; an unreadable file: no)."""
    try:
        with safe_open(path, framework="pt") as handle:
            return tensor in handle.keys()
    except (OSError, SafetensorError):
        return False
