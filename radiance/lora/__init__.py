"""Serving PEFT LoRA adapters on any served base, several adapters in one batch (vLLM's multi-LoRA)."""

from radiance.lora.adapter import LoraAdapter, LoraAdapterError, LoraTarget, load_adapter
from radiance.lora.layers import LoraLinear, LoraStepContext, install_lora_layers
from radiance.lora.manager import LoraManager
from radiance.lora.request import LoRARequest

__all__ = ["LoRARequest", "LoraAdapter", "LoraAdapterError", "LoraLinear", "LoraManager", "LoraStepContext",
           "LoraTarget", "install_lora_layers", "load_adapter"]
