"""The in-memory form every reader produces (see docs/ARCHITECTURE.md, section checkpoint)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

import torch

from radiance.checkpoint.quant_config import QuantSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryInfo:
    """What `names()` yields, described without reading tensor data (for `inspect`)."""

    name: str  # canonical name
    is_linear: bool
    format: str  # "dense" | "mxfp4" | "nvfp4" | "fp8" for linears; the dtype (or GGUF type) otherwise
    shape: tuple[int, ...]  # (N, K) for linears
    partition_sizes: tuple[int, ...] = ()
    nbytes: int = 0  # bytes on disk
    source_format: str = ""  # e.g. "Q4_1" for GGUF tensors


@dataclass
class Checkpoint(ABC):
    """Base of the HF and GGUF readers."""

    path: str
    kind: str  # "hf" | "gguf"
    config: dict
    quant: QuantSpec
    warnings: list[str] = field(default_factory=list)
    # calibrated fp8 KV-cache scales, "model.layers.{i}.self_attn.k_scale" / "...v_scale" -> value
    attention_scales: dict[str, float] = field(default_factory=dict)

    def warn(self, message: str) -> None:
        """A fault the checkpoint is served despite: logged once, and kept for `inspect` to list."""
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)

    def names(self) -> list[str]:
        return [e.name for e in self.describe()]

    def stored_name(self, name: str) -> str:
        """The checkpoint's own name of entry `name` (describe's names merge q / k / v): the reader's to map."""
        return name

    def resolve_architecture(self):
        """(model class, ArchConfig) for this checkpoint's config, or the registry's ConfigError in the
        checkpoint's own words (a GGUF has no config.json: its metadata keys are named)."""
        from radiance.errors import ConfigError
        from radiance.models.registry import resolve_architecture

        try:
            return resolve_architecture(self.config)
        except ConfigError as exc:
            raise self.config_error(exc) from None

    def config_error(self, exc: Exception) -> Exception:
        """`exc`, a fault of the config dict, as this checkpoint stores that config: config.json as it is."""
        return exc

    def file_of(self, name: str) -> str:
        """The file holding tensor `name`, for error messages: the checkpoint's path unless a reader knows better."""
        return self.path

    @abstractmethod
    def describe(self) -> list[EntryInfo]:
        ...

    @abstractmethod
    def iter_weights(self, progress: bool = True) -> Iterator[tuple[str, object]]:
        """(canonical name, Weight | torch.Tensor), one at a time."""
        ...

    @abstractmethod
    def tokenizer(self):
        ...

    @property
    def has_tokenizer(self) -> bool:
        """Whether the checkpoint carries a tokenizer (found without loading it); without one only token-id prompts
        can be served."""
        return True

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        ...

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every chat template by name ("default", and named ones such as "tool_use" where the model ships them)."""
        return {"default": self.chat_template} if self.chat_template else {}

    def template_source(self, template: str) -> str:
        """Where `template` (one of chat_templates) was read from, for its parse errors: "file PATH[, metadata KEY]"."""
        return f"file {self.path}"

    @property
    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        ...

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [self.config.get("model_type", "unknown")]
        return str(archs[0])

    @property
    def tie_word_embeddings(self) -> bool:
        """config.json's, or the architecture's default where it says nothing (Gemma: tied)."""
        from radiance.models.arch_config import config_defaults

        value = self.config.get("tie_word_embeddings")
        return bool(config_defaults(self.config).tie_word_embeddings if value is None else value)

    def state_dict(self, progress: bool = False) -> dict[str, object]:
        """Everything at once (small models and tests only)."""
        return dict(self.iter_weights(progress=progress))


def is_weight(obj: object) -> bool:
    """True for the linear Weight containers of radiance.formats (not plain tensors)."""
    return not isinstance(obj, torch.Tensor) and hasattr(obj, "partition_sizes") and hasattr(obj, "format")
