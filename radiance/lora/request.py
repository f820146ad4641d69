"""LoRARequest: which adapter a request runs with (vLLM's class of the same name and fields)."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and int id (>= 1: it identifies the adapter in the engine) and where to load it from (a
    directory with adapter_config.json and adapter_model.safetensors, or a Hugging Face Hub id); "" for an adapter
    the engine has already loaded under that id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, Integral) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")
        object.__setattr__(self, "lora_int_id", int(self.lora_int_id))

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
