"""Writing checkpoints in the compressed-tensors layout (`radiance convert`).

The output is an ordinary HF directory: config.json with a `quantization_config` that the
compressed-tensors library accepts (schemes as in its MXFP4A16 / NVFP4A16 / FP8_DYNAMIC presets),
safetensors shards (+ index), tokenizer files and generation_config.json. Merged linears are split
back into their projections (q/k/v, gate/up), each NVFP4 partition with its own global scale.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Iterator

import torch

from radiance.checkpoint.base import Checkpoint, is_weight
from radiance.checkpoint.convert import convert_weights
from radiance.checkpoint.layout import plain_tensor, split_partitions, weight_tensors
from radiance.checkpoint.names import partition_modules
from radiance.checkpoint.report import RequantReport
from radiance.checkpoint.safetensors_io import ShardWriter
from radiance.checkpoint.servable import check_servable
from radiance.config import ConvertConfig
from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
NAMED_TEMPLATES_DIR = "additional_chat_templates"  # transformers' save_pretrained: tool_use.jinja, ...
# weights-only schemes: activations are quantized by the serving kernel, so no input scales are stored
_WEIGHT_ARGS = {
    "mxfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
              "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.uint8",
              "zp_dtype": None, "observer": "minmax", "observer_kwargs": {}},
    "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.float8_e4m3fn",
              "zp_dtype": None, "observer": "minmax", "observer_kwargs": {}},
    "fp8": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}},
}
_FP8_INPUT = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "token",
              "block_structure": None, "dynamic": True, "actorder": None, "observer": None, "observer_kwargs": {}}
STORAGE = {"mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized", "fp8": "float-quantized"}


def quantization_config_for(fmt: str, ignore: list[str], rule: str | None = None) -> dict:
    """A compressed-tensors quantization_config for linears stored in `fmt`, `ignore` = module names."""
    group = {"targets": ["Linear"], "weights": dict(_WEIGHT_ARGS[fmt]),
             "input_activations": dict(_FP8_INPUT) if fmt == "fp8" else None,
             "output_activations": None, "format": STORAGE[fmt]}
    config = {"quant_method": "compressed-tensors", "format": STORAGE[fmt], "quantization_status": "compressed",
              "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
              "global_compression_ratio": None, "provider": "radiance"}
    if rule is not None and fmt == "mxfp4":
        config["radiance"] = {"mxfp4_rule": rule}  # provenance; other readers ignore unknown top-level keys
    return config


def _with_untied_head(items: Iterator, quantize_lm_head: bool, tied: bool) -> Iterator:
    """A tied lm_head that is to be quantized needs its own tensor: emit a copy of the embeddings.

    A 16-bit lm_head.weight stored beside tied embeddings is dropped: the served model (like vLLM's) reads the
    embeddings instead (transformers 5 serves a stored head that differs; radiance's load warns of one), and written
    out it would replace the quantized copy of them."""
    for name, obj in items:
        if tied and name == "lm_head.weight":
            continue
        yield name, obj
        if quantize_lm_head and tied and name == "model.embed_tokens.weight":
            yield "lm_head.weight", obj.clone()


def _source_tokenizer(ckpt: Checkpoint):
    """A GGUF's tokenizer, built before any tensor is read (broken tokenizer metadata fails first). A GGUF without
    tokenizer metadata converts weights-only, with a warning, as an HF directory without tokenizer files does.
    An HF directory's tokenizer files are copied as they are, once they load: a corrupt tokenizer.json was
    copied without a word, to fail at DST."""
    if ckpt.kind == "hf":
        if ckpt.has_tokenizer:
            ckpt.tokenizer()
        return None
    if not getattr(ckpt, "has_tokenizer", True):
        logger.warning("%s has no tokenizer metadata; the converted checkpoint has no tokenizer either "
                       "(token-id prompts only, or add tokenizer files to it)", ckpt.path)
        return None
    return ckpt.tokenizer()


def _copy_side_files(ckpt: Checkpoint, dst: str, tokenizer=None) -> None:
    """Tokenizer, chat template and generation config next to the weights (`tokenizer`: _source_tokenizer's)."""
    if ckpt.kind == "hf":
        copied = [n for n in TOKENIZER_FILES + ("generation_config.json",)
                  if os.path.exists(os.path.join(ckpt.path, n))]
        for name in copied:
            shutil.copyfile(os.path.join(ckpt.path, name), os.path.join(dst, name))
        if os.path.isdir(os.path.join(ckpt.path, NAMED_TEMPLATES_DIR)):
            shutil.copytree(os.path.join(ckpt.path, NAMED_TEMPLATES_DIR), os.path.join(dst, NAMED_TEMPLATES_DIR))
        if not any(n.startswith("tokenizer") for n in copied):
            logger.warning("%s has no tokenizer files; the converted checkpoint has none either", ckpt.path)
        if "generation_config.json" in copied:
            return
    elif tokenizer is not None:
        if ckpt.chat_template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = ckpt.chat_template
        tokenizer.save_pretrained(dst)
    eos = ckpt.eos_token_ids
    generation = {"bos_token_id": ckpt.config.get("bos_token_id"),
                  "eos_token_id": eos if len(eos) != 1 else eos[0]}
    with open(os.path.join(dst, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({k: v for k, v in generation.items() if v not in (None, [])}, handle, indent=2)


def convert_checkpoint(src, dst: str, config: ConvertConfig = ConvertConfig(), progress: bool = True) -> RequantReport:
    """Read `src` (path, None = embedded model, or an open Checkpoint), write `config.format` to `dst`.

    On any failure `dst` is left as it was found (absent or empty): a half-written directory would refuse the
    next attempt, or, with shards but no config.json, pass for a model at a glance.
    """
    from radiance.checkpoint import open_checkpoint

    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    check_servable(ckpt)  # convert only rewrites linears: a model radiance cannot load stays one
    tokenizer = _source_tokenizer(ckpt)
    dst = os.path.abspath(dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CheckpointError("destination exists and is not an empty directory; choose a new one", file=dst)
    if os.path.abspath(ckpt.path) == dst:
        raise CheckpointError("destination is the source", file=dst)
    created = _first_missing(dst)
    try:
        return _convert(ckpt, dst, config, progress, tokenizer)
    except BaseException as exc:  # Ctrl-C included
        _discard(dst, created)
        if isinstance(exc, OSError):  # no room, no permission, a file where a directory should be
            where = str(exc.filename or dst)
            verb = "write" if where.startswith(created or dst) else "read"
            raise CheckpointError(f"cannot {verb} while converting: {exc.strerror or exc}", file=where) from None
        raise


def _first_missing(path: str) -> str | None:
    """The topmost directory of `path` that does not exist yet (what writing it creates); None if it exists."""
    top = None
    while path and not os.path.exists(path):
        top, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return top


def _discard(dst: str, created: str | None) -> None:
    """Undo a failed conversion: remove what it created, or empty the (empty before) destination."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for name in os.listdir(dst) if os.path.isdir(dst) else ():
        path = os.path.join(dst, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


@contextlib.contextmanager
def _naming(tensor: str, ckpt: Checkpoint):
    """A 16-bit cast that fails (fp32 values beyond float16's range) becomes a CheckpointError naming the tensor
    and its shard."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as exc:
        raise CheckpointError(f"cannot write it 16-bit: {exc} (--dense-dtype bfloat16 holds it)", file=ckpt.file_of(tensor),
                              tensor=tensor) from None


def _convert(ckpt: Checkpoint, dst: str, config: ConvertConfig, progress: bool, tokenizer=None) -> RequantReport:
    dense_dtype = getattr(torch, config.dense_dtype)
    report = RequantReport(config.format, config.rule if config.format == "mxfp4" else None)
    logger.info("converting %s -> %s (%s%s)", ckpt.path, dst, config.format,
                f", rule {config.rule}" if config.format == "mxfp4" else "")
    writer = ShardWriter(dst, config.max_shard_bytes)
    kept_dense: list[str] = []
    # closed on a failure too: its progress bar ends before the error is printed, not under it
    with contextlib.closing(ckpt.iter_weights(progress=progress)) as weights:
        _write_weights(ckpt, writer, config, report, dense_dtype, weights, kept_dense)
    files = writer.finish()

    out_config = {k: v for k, v in ckpt.config.items()
                  if k not in ("quantization_config", "compression_config", "gguf_file_type", "served_from")}
    out_config["torch_dtype"] = config.dense_dtype
    if "dtype" in out_config:  # transformers 5's name, which it reads first: not the source's stale one
        out_config["dtype"] = config.dense_dtype
    if config.quantize_lm_head:
        out_config["tie_word_embeddings"] = False
    ignore = kept_dense if ("lm_head" in kept_dense or config.quantize_lm_head) else ["lm_head"] + kept_dense
    rule = _rule_applied(ckpt, config, report)
    out_config["quantization_config"] = quantization_config_for(config.format, ignore, rule)
    _copy_side_files(ckpt, dst, tokenizer)
    # config.json last: its presence marks a complete conversion
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(out_config, handle, indent=2)
    logger.info("wrote %s (%d file(s), %.1f MiB)", dst, len(files), writer.total_bytes / 2**20)
    return report


def _rule_applied(ckpt: Checkpoint, config: ConvertConfig, report: RequantReport) -> str | None:
    """The MXFP4 rule to record as provenance: this conversion's when it requantized a linear to MXFP4; else the
    source's own record (its MXFP4 linears were copied as they were, so --rule did nothing: said when one was given)."""
    if any(entry.target_format == "mxfp4" for entry in report.entries):
        return config.rule
    source = ((ckpt.config.get("quantization_config") or {}).get("radiance") or {}).get("mxfp4_rule")
    if config.format == "mxfp4" and config.rule != ConvertConfig.rule:
        logger.warning("--rule %s did nothing: every quantized linear of %s already was MXFP4 and was copied as it "
                       "was%s", config.rule, ckpt.path, f" (converted with rule {source})" if source else "")
    return source


def _write_weights(ckpt: Checkpoint, writer: ShardWriter, config: ConvertConfig, report: RequantReport, dense_dtype,
                   weights, kept_dense: list[str]) -> None:
    """Every tensor of `weights` converted to `config.format` and handed to `writer`; the linears kept 16-bit are
    added to `kept_dense`."""
    written: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}  # linear -> (modules written, their rows)
    items = _with_untied_head(weights, config.quantize_lm_head, ckpt.tie_word_embeddings)
    for name, obj in convert_weights(items, config.format, config.rule, config.ignore, config.quantize_lm_head,
                                     report, config.chunk_rows, dense_dtype, file_of=ckpt.file_of):
        if is_weight(obj):
            parts = split_partitions(obj)
            # a merged linear the source stored whole (Phi-3's qkv_proj, gate_up_proj) is written whole
            modules = partition_modules(name) if len(parts) > 1 else (name,)
            if len(parts) != len(modules):
                raise CheckpointError(f"{name} has {len(parts)} partitions, expected {len(modules)}", tensor=name)
            written[name] = (modules, obj.partition_sizes)
            for module, part in zip(modules, parts):
                with _naming(f"{module}.weight", ckpt):
                    tensors = weight_tensors(module, part, dense_dtype)
                for tensor_name, tensor in tensors.items():
                    writer.add(tensor_name, tensor)
                if part.format == "dense":
                    kept_dense.append(module)
        elif name.endswith(".bias") and name[: -len(".bias")] in written:
            modules, sizes = written[name[: -len(".bias")]]
            for module, piece in zip(modules, torch.split(obj, sizes)):
                with _naming(f"{module}.bias", ckpt):
                    writer.add(f"{module}.bias", plain_tensor(piece, dense_dtype))
        else:
            with _naming(name, ckpt):
                writer.add(name, plain_tensor(obj, dense_dtype, name))
