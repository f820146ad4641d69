"""The tokenizer of a Hugging Face model directory: whether it ships one, and loading it through transformers with
errors that name the file at fault (transformers' own messages name none)."""

from __future__ import annotations

import logging
import os

from radiance.checkpoint.hf_config import load_json
from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

# a tokenizer's own files (tokenizer_config.json alone is settings, not a vocabulary); Kimi's: *.tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether the directory holds a vocabulary (found without loading it)."""
    names = os.listdir(model_dir)
    return any(name in TOKENIZER_FILES or name.endswith(".tiktoken") for name in names)


def load_tokenizer(model_dir: str):
    """transformers' AutoTokenizer of the directory, or a CheckpointError naming the file that stops it."""
    from transformers import AutoTokenizer
    if not has_tokenizer_files(model_dir) and not os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        raise CheckpointError(f"no tokenizer files (none of {', '.join(TOKENIZER_FILES)}, *.tiktoken or "
                              "tokenizer_config.json)", file=model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        _check_tokenizer_json(model_dir)  # a file that is not JSON is named (transformers names none)
        refused = _tokenizer_json_refusal(model_dir)
        if refused is not None:
            raise CheckpointError(f"cannot load the tokenizer: tokenizer.json is JSON but not a tokenizer "
                                  f"({refused})", file=os.path.join(model_dir, "tokenizer.json")) from None
        if not has_tokenizer_files(model_dir):  # transformers' answer: "install sentencepiece or tiktoken"
            raise CheckpointError(f"cannot load the tokenizer: tokenizer_config.json is here, but no vocabulary "
                                  f"(none of {', '.join(TOKENIZER_FILES)} or *.tiktoken): copy the tokenizer files "
                                  "of the original model", file=model_dir) from None
        config_fault = _transformers_config_fault(model_dir)
        if config_fault is not None:  # transformers reads config.json to pick the tokenizer class
            tokenizer = _without_model_config(model_dir, config_fault)
            if tokenizer is not None:
                return tokenizer
            raise CheckpointError(f"cannot load the tokenizer: transformers, which reads config.json to "
                                  f"choose the tokenizer, cannot read it ({config_fault})",
                                  file=os.path.join(model_dir, "config.json")) from None
        one_line = " ".join(str(exc).split())  # transformers' messages span lines
        raise CheckpointError(f"cannot load the tokenizer: {one_line}", file=model_dir) from None


def _without_model_config(model_dir: str, config_fault: str):
    """The tokenizer loaded without config.json, which transformers cannot read but radiance can (a `torch_dtype` torch
    lacks: radiance picks its own dtype), with a warning; None when that fails too. tokenizer_config.json names the
    class; without it transformers takes tokenizer.json as it is."""
    from transformers import AutoTokenizer, PretrainedConfig
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, config=PretrainedConfig())
    except Exception:  # noqa: BLE001 - the caller reports the config fault instead
        return None
    logger.warning("transformers cannot read %s (%s): the tokenizer was loaded without it",
                   os.path.join(model_dir, "config.json"), config_fault)
    return tokenizer


def _transformers_config_fault(model_dir: str) -> str | None:
    """Why transformers cannot read this config.json (a `torch_dtype` torch lacks, say), or None."""
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - any refusal is the answer
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _tokenizer_json_refusal(model_dir: str) -> str | None:
    """Why the tokenizers library refuses tokenizer.json (JSON of another shape), or None: transformers' own
    message ("'added_tokens'") named no file."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception
        return str(exc)
    return None


def _check_tokenizer_json(model_dir: str) -> None:
    """A tokenizer JSON file that does not parse, as a CheckpointError naming it."""
    for name in _TOKENIZER_JSON:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            load_json(path, name)
