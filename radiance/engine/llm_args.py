"""vLLM's arguments of `LLM(...)`, `LLM.generate` and `LLM.chat` as radiance takes them: those that change nothing
here, those taken only at the values that mean what radiance does anyway, and the checks of the rest (split out of
llm.py, which keeps the calls themselves)."""

from __future__ import annotations

import os
from numbers import Integral

import torch

from radiance.config import DTYPE_ALIASES, DTYPES
from radiance.errors import ConfigError

# vLLM's LLM(...) arguments that change nothing here: radiance runs no code of a model's own (trust_remote_code),
# keeps no stats log, recomputes preempted sequences rather than swapping them, and names no model (the server does)
VLLM_NO_EFFECT_ARGS = ("trust_remote_code", "disable_log_stats", "swap_space", "served_model_name",
                       "disable_custom_all_reduce", "max_seq_len_to_capture")
# vLLM's arguments radiance takes only at the values that mean what it does anyway: name -> (values, why)
VLLM_DEFAULT_ONLY_ARGS = {
    "tensor_parallel_size": ((1,), "radiance serves a model on one device"),
    "pipeline_parallel_size": ((1,), "radiance serves a model on one device"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model's own"),
    "skip_tokenizer_init": ((False,), "the model's tokenizer is loaded with it (one without takes token-id prompts)"),
    "cpu_offload_gb": ((0,), "weights are not offloaded"),
    "load_format": (("auto", "safetensors", "gguf"), "weights are read from the checkpoint's own files"),
    "task": (("auto", "generate"), "radiance generates text"),
    "runner": (("auto", "generate"), "radiance generates text"),
}
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# vLLM's tokenization_kwargs (generate's text prompts, chat's rendered template) that the tokenizer call honours
TOKENIZATION_KWARGS = ("add_special_tokens", "truncation", "max_length")
# template variables chat() sets itself and no keyword may: what to pass instead
_TEMPLATE_OWN_ARGS = {"messages": "pass the conversation as chat()'s messages",
                      "template": "pass a template as chat()'s chat_template",
                      "chat_template_content_format": "pass it as chat()'s chat_template_content_format"}


def _vllm_model_args(model: str | None, config: dict) -> str | None:
    """Takes vLLM's LLM(...) arguments out of `config`: those that change nothing here are dropped, the others
    refused by name unless they say what radiance does anyway; `revision` is folded into the Hub id
    (org/name@revision). Returns the model."""
    for name in VLLM_NO_EFFECT_ARGS:
        config.pop(name, None)
    for name, (values, why) in VLLM_DEFAULT_ONLY_ARGS.items():
        if name in config and (given := config.pop(name)) not in values:
            accepted = " or ".join(map(repr, values))
            raise ConfigError(f"{name} must be {accepted} here: {why}; got {given!r}")
    tokenizer = config.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise ConfigError(f"tokenizer {tokenizer!r}: radiance reads the tokenizer of the model itself (its "
                          "directory or GGUF file); a separate one is not supported")
    revision = config.pop("revision", None)
    if revision is None:
        return model
    if model is None or os.path.exists(model) or "@" in model:
        raise ConfigError(f"revision {revision!r} applies to a Hugging Face Hub id without one, got model {model!r}")
    return f"{model}@{revision}"


def _dtype_name(dtype) -> str | None:
    """The engine's name of `dtype`: one of DTYPES, vLLM's half / float / auto, or a torch dtype of those."""
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[dtype]
    if dtype is None or isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_ALIASES:
        return DTYPE_ALIASES[dtype]
    raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, vLLM's {', '.join(DTYPE_ALIASES)} or a torch "
                      f"dtype of those, got {dtype!r}")


def _max_logprobs(value) -> int | None:
    if value is None or value == -1:  # vLLM's -1: no limit but the vocabulary
        return None
    if not isinstance(value, Integral) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"max_logprobs must be a non-negative integer or -1, got {value!r}")
    return int(value)


def check_priority(priority, num_prompts: int) -> None:
    """vLLM's generate(priority=[...]): one int per prompt. Radiance schedules first-come-first-served, so only
    all zeros (what vLLM's default scheduling gives every request) are taken."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or not all(isinstance(p, Integral) and not isinstance(p, bool)
                                                         for p in priority):
        raise ValueError(f"priority must be a list of integers (one per prompt), got {_short(priority)}")
    if len(priority) != num_prompts:
        raise ValueError(f"priority has {len(priority)} values for {num_prompts} prompts; give one per prompt")
    if any(priority):
        raise ValueError(f"priority must be all 0: radiance schedules requests first-come-first-served (no priority "
                         f"scheduling), got {_short(list(priority))}")


def check_lora_request(lora_request, num_prompts: int, enabled: bool) -> list:
    """vLLM's lora_request of generate / chat / beam_search as one entry per prompt: None (the base), one
    LoRARequest for every prompt, or a list (or tuple) with one LoRARequest or None per prompt. Any adapter while
    LoRA is not enabled is refused."""
    from radiance.lora import LoRARequest

    if lora_request is None:
        return [None] * num_prompts
    if not enabled:
        raise ValueError(f"lora_request must be None unless LoRA is enabled (LLM(enable_lora=True), --enable-lora), "
                         f"got {_short(lora_request)}")
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)) or not all(r is None or isinstance(r, LoRARequest)
                                                             for r in lora_request):
        raise ValueError(f"lora_request must be None, a LoRARequest or a list of them (one per prompt), "
                         f"got {_short(lora_request)}")
    if len(lora_request) != num_prompts:
        raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts; give one per prompt")
    return list(lora_request)


def tokenizer_kwargs(given, defaults: dict | None = None) -> dict:
    """vLLM's tokenization_kwargs over `defaults`, as the tokenizer call takes them: add_special_tokens, truncation
    and max_length (with truncation, the prompt is cut to max_length tokens, as the tokenizer cuts). Other keys are
    refused, as are values of the wrong type."""
    if given is None:
        return dict(defaults or {})
    if not isinstance(given, dict):
        raise ValueError(f"tokenization_kwargs must be a dict, got {_short(given)}")
    unknown = sorted(set(given) - set(TOKENIZATION_KWARGS), key=str)
    if unknown:
        raise ValueError(f"tokenization_kwargs {', '.join(map(repr, unknown))} not supported: radiance takes "
                         f"{', '.join(TOKENIZATION_KWARGS)}")
    for name in ("add_special_tokens", "truncation"):
        if name in given and not isinstance(given[name], bool):
            raise ValueError(f"tokenization_kwargs {name!r} must be true or false, got {given[name]!r}")
    length = given.get("max_length")
    if length is not None and (not isinstance(length, Integral) or isinstance(length, bool) or length < 1):
        raise ValueError(f"tokenization_kwargs 'max_length' must be a positive integer, got {length!r}")
    return {**(defaults or {}), **given}


def check_chat_args(content_format, mm_processor_kwargs) -> None:
    """vLLM's chat() keywords that would otherwise reach the template as variables."""
    from radiance.server.chat_template import content_format_of  # imported on use, as LLM.apply_chat_template does

    content_format_of(None, content_format)  # "auto", "string" or "openai": refused before any render
    if mm_processor_kwargs is not None:
        raise ValueError(f"mm_processor_kwargs must be None: radiance serves text only (no multimodal inputs), got "
                         f"{_short(mm_processor_kwargs)}")


def template_variables(template_kwargs: dict, chat_template_kwargs: dict | None) -> dict:
    """chat()'s template variables: its other keywords, chat_template_kwargs over them; a null value leaves the
    variable unset, as the server reads chat_template_kwargs ({% if x is defined %})."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {_short(chat_template_kwargs)}")
    variables = {k: v for k, v in {**template_kwargs, **(chat_template_kwargs or {})}.items() if v is not None}
    for key, use in _TEMPLATE_OWN_ARGS.items():
        if key in variables:  # was a bare "got multiple values for argument" TypeError
            raise ValueError(f"chat_template_kwargs may not set {key!r}: {use}")
    return variables


def conversations_of(messages) -> list:
    """chat()'s messages as a list of conversations: one conversation (a list of message dicts), or a list or
    tuple of them (vLLM takes any sequence of conversations)."""
    one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if one else messages
    if not isinstance(conversations, (list, tuple)) or not all(_is_conversation(c) for c in conversations):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
    return [list(c) for c in conversations]


def _is_conversation(messages) -> bool:
    return isinstance(messages, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in messages)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
