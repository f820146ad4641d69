"""Checkpoint reading, writing and inspection.

`open_checkpoint(path)` reads an HF directory (16-bit, compressed-tensors nvfp4/mxfp4/fp8, Quark OCP MX)
or a GGUF file (None = the embedded SmolLM2) into one in-memory form: linears as `radiance.formats`
Weight objects under merged canonical names, everything else as plain tensors.
"""

from __future__ import annotations

import glob
import os

from radiance.errors import CheckpointError

__all__ = ["Checkpoint", "EntryInfo", "RequantReport", "open_checkpoint", "is_weight", "embedded_model_path",
           "convert_checkpoint", "model_name", "EMBEDDED_MODEL_NAME"]


EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED = "embedded"  # what every command takes for the embedded model (unless a local path has that name)


def __getattr__(name):  # lazy: `radiance --help` imports this package's CLI module, and base imports torch
    if name in ("Checkpoint", "EntryInfo", "is_weight"):
        from radiance.checkpoint import base
        return getattr(base, name)
    if name == "RequantReport":
        from radiance.checkpoint.report import RequantReport
        return RequantReport
    raise AttributeError(f"module 'radiance.checkpoint' has no attribute {name!r}")


def model_name(path: str | None) -> str:
    """The name a model is served under: its directory or file name without .gguf; a Hugging Face Hub id as given
    (what vLLM serves it as, so clients keep their model field); None = the embedded model."""
    if path is None or (path == EMBEDDED and not os.path.exists(path)):
        return EMBEDDED_MODEL_NAME
    from radiance.checkpoint.hub import hub_model
    if not os.path.exists(os.path.expanduser(path)) and hub_model(path) is not None:
        return path
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def embedded_model_path() -> str:
    from radiance.checkpoint.gguf_reader import embedded_model_path as find
    return find()


def open_checkpoint(path: str | None = None) -> Checkpoint:
    """Open a model: an HF directory, a .gguf file, a directory holding one .gguf, a Hugging Face Hub id (`org/name`,
    checkpoint.hub: fetched into its cache), or None (embedded SmolLM2)."""
    if path is None or (path == EMBEDDED and not os.path.exists(path)):  # every command's name for it
        path = embedded_model_path()
    if not str(path).strip():  # "" (an unset shell variable): as a path it names no file at all
        raise CheckpointError("the model path is empty: give an HF model directory or a .gguf file")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        from radiance.checkpoint.hub import fetch, hub_model
        hub = hub_model(path)
        if hub is None:
            raise CheckpointError("no such file or directory", file=path)
        path = fetch(hub)  # org/name: the Hugging Face Hub's, cached
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):  # else it reads as empty: "holds neither config.json nor ..."
            raise CheckpointError("permission denied: the directory is not readable", file=path)
        if os.path.exists(os.path.join(path, "config.json")):
            from radiance.checkpoint.hf_reader import HfCheckpoint
            return HfCheckpoint(path)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if not ggufs and glob.glob(os.path.join(path, "*.safetensors")):  # HF weights without their config
            raise CheckpointError("config.json not found next to the .safetensors files",
                                  file=os.path.join(path, "config.json"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            what = "several .gguf files (name one)" if ggufs else "neither config.json nor a .gguf file"
            raise CheckpointError(f"not a model directory: it holds {what}", file=path)
    if path.endswith(".gguf"):
        from radiance.checkpoint.gguf_reader import GgufCheckpoint
        return GgufCheckpoint(path)
    if path.endswith(".safetensors"):  # a model's weights, read with the config.json beside them
        raise CheckpointError("a .safetensors file alone is no model: give the directory holding it and its "
                              "config.json", file=path)
    name, folder = os.path.basename(path), os.path.dirname(path) or "."
    if (name in _MODEL_FOLDER_FILES or name.endswith(".index.json")) and _is_hf_folder(folder):
        raise CheckpointError(f"{name} alone is no model: give the directory holding it, {folder}", file=path)
    raise CheckpointError("not a model: expected an HF directory with config.json or a .gguf file", file=path)


# the files of an HF model folder other than its weights, which a user may name in place of the folder
_MODEL_FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _is_hf_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) or bool(glob.glob(os.path.join(folder, "*.safetensors")))


def convert_checkpoint(*args, **kwargs):
    """See `radiance.checkpoint.writer.convert_checkpoint`."""
    from radiance.checkpoint.writer import convert_checkpoint as convert
    return convert(*args, **kwargs)
