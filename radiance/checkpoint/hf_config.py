"""config.json: loading it with errors a user can act on, and the shapes it implies.

The shapes let the reader reject a tensor of the wrong size with a message that names it, instead of
failing later inside a matmul.
"""

from __future__ import annotations

import json
import os
import re

from radiance.checkpoint.names import LINEAR_ATTENTION_LINEARS
from radiance.errors import CheckpointError


def unreadable_file(path: str) -> str | None:
    """Why `path` cannot be read before opening it (a FIFO would block the open for ever; safetensors
    reports a file it may not read as missing), or None (also for a missing one: each caller words that)."""
    if os.path.exists(path) and not os.path.isfile(path):
        return "not a regular file (a FIFO, device or directory)"
    if os.path.isfile(path) and not os.access(path, os.R_OK):
        return "permission denied: the file is not readable"
    return None


def load_json(path: str, what: str) -> dict:
    unreadable = unreadable_file(path)  # a FIFO would block the open
    if unreadable:
        raise CheckpointError(f"cannot read {what}: {unreadable}", file=path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found", file=path) from None
    except OSError as exc:  # an I/O error
        raise CheckpointError(f"cannot read {what}: {exc.strerror or exc}", file=path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} is not valid JSON: {exc}", file=path) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} must hold a JSON object, got {type(data).__name__}", file=path)
    return data


# sizes the expected shapes are computed from: a string or 0 here would surface as a baffling shape error
_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "moe_intermediate_size")

# switches a string would turn on ("false" is a non-empty, truthy string)
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def load_config(model_dir: str) -> dict:
    """Read `config.json` of an HF model directory and check the fields radiance relies on."""
    path = os.path.join(model_dir, "config.json")
    config = load_json(path, "config.json")
    for key in _SIZES:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise CheckpointError(f"config.json field {key!r} must be a positive integer, got {value!r}", file=path)
    for key in _FLAGS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):  # "false" was truthy: the head was dropped
            raise CheckpointError(f"config.json field {key!r} must be true or false, got {value!r}", file=path)
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"config.json field 'architectures' must be a list of class names, got {archs!r}",
                              file=path)
    return config


# Where a vision-language checkpoint keeps its language model's tensors (older transformers saves first, then
# transformers >= 4.52's), and what a text-only checkpoint of that model calls them; its other tensors (the vision
# tower, the projector) are not served.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."), ("lm_head.", "lm_head."))
# keys of a vision-language config.json that describe its language model's weights too (over text_config's)
_SHARED_KEYS = ("quantization_config", "compression_config", "torch_dtype", "dtype", "tie_word_embeddings")


# Mixtral's sparse MLP as Qwen-MoE's names it, which radiance's model reads: the block, the router, the experts'
# w1 (gate), w3 (up) and w2 (down)
_MIXTRAL_MLP = re.compile(r"\.block_sparse_moe\.(gate\.|experts\.\d+\.(w[123])\.)")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_tensor(name: str) -> str:
    """A Mixtral checkpoint's tensor name in the naming radiance's sparse MLP reads (others unchanged)."""
    match = _MIXTRAL_MLP.search(name)
    if match is None:
        return name
    part = match.group(1)
    if match.group(2):
        part = part.replace(f"{match.group(2)}.", f"{_MIXTRAL_EXPERT[match.group(2)]}.")
    return f"{name[:match.start()]}.mlp.{part}{name[match.end():]}"


# Llama 4's MLP (dense or sparse) as the other models name it: `feed_forward` is `mlp`, its router the sparse MLP's gate
_LLAMA4_MLP = re.compile(r"\.feed_forward\.(router\.)?")


def llama4_tensor(name: str) -> str:
    """A Llama 4 checkpoint's tensor name in the naming radiance's decoder and sparse MLP read (others unchanged)."""
    match = _LLAMA4_MLP.search(name)
    if match is None:
        return name
    return f"{name[:match.start()]}.mlp.{'gate.' if match.group(1) else ''}{name[match.end():]}"


# GLM-4.5's layers past num_hidden_layers: its multi-token-prediction module (a draft model radiance does not run)
_LAYER_OF = re.compile(r"^model\.layers\.(\d+)\.")


def glm4_moe_renames(num_layers: int):
    """GLM-4.5's tensor names as radiance's decoder reads them: `shared_experts` is Qwen-MoE's `shared_expert`; the
    layers from num_layers on (the multi-token-prediction layer) are not read (None), as transformers skips them."""
    def rename(name: str) -> str | None:
        layer = _LAYER_OF.match(name)
        if layer is not None and int(layer.group(1)) >= num_layers:
            return None
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    return rename


def _without_mtp(name: str) -> str | None:
    """Qwen3.5's and Qwen3-Next's multi-token-prediction weights (`mtp.*`, a draft model radiance does not run) are
    not read, as transformers skips them."""
    return None if name.startswith("mtp.") else name


def tensor_renames(config: dict, text_only: bool):
    """The stored -> served tensor names of a checkpoint (SafetensorsIndex's rename), or None: a vision-language
    checkpoint's language model, Mixtral's, Llama 4's and GLM-4.5's MLPs, Qwen3.5's / Qwen3-Next's MTP weights."""
    names = config.get("architectures") or []
    if ("Glm4MoeForCausalLM" in names or config.get("model_type") == "glm4_moe") and not text_only \
            and isinstance(config.get("num_hidden_layers"), int):
        return glm4_moe_renames(config["num_hidden_layers"])
    if any(name in LINEAR_ATTENTION_LINEARS for name in names) and not text_only:
        return _without_mtp
    if "Llama4ForCausalLM" in names or config.get("model_type") in ("llama4", "llama4_text"):
        if text_only:
            return lambda name: _renamed(language_model_tensor(name), llama4_tensor)
        return llama4_tensor
    if text_only:
        return language_model_tensor
    if "MixtralForCausalLM" in names or config.get("model_type") == "mixtral":
        return mixtral_tensor
    return None


def _renamed(name: str | None, rename) -> str | None:
    return None if name is None else rename(name)


def language_model_tensor(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as its language model alone names it; None for the others."""
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None


def language_model(config: dict, file: str = "config.json") -> dict | None:
    """For a vision-language checkpoint (Mistral Small 3.x's Mistral3ForConditionalGeneration, Pixtral's
    LlavaForConditionalGeneration, ...) whose language model radiance serves: that model's config.json, as a text-only
    checkpoint of it would have (its `text_config`, named by its model_type, with the quantization and dtype the
    whole checkpoint gives), and `served_from` naming the wrapper. None for any other config: one whose language
    model radiance does not serve opens as it is, for `inspect` to show and the model registry to refuse."""
    from radiance.models.arch_config import MODEL_TYPES

    names = config.get("architectures") or []
    text = config.get("text_config")
    if not any(name.endswith("ForConditionalGeneration") for name in names) or text is None:
        return None
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json field 'text_config' must be an object, got {text!r}", file=file)
    model_type = text.get("model_type")
    if model_type not in MODEL_TYPES:
        return None
    flat = dict(text)
    flat.update({key: config[key] for key in _SHARED_KEYS if key in config})  # transformers ties by the top level
    flat["architectures"] = [MODEL_TYPES[model_type]]
    flat["served_from"] = names[0]
    return flat


def modelopt_quant_file(model_dir: str) -> tuple[dict | None, str]:
    """(quantization_config, its file) from `hf_quant_config.json`, where NVIDIA ModelOpt exports put it
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ...}}); (None, "") without one."""
    path = os.path.join(model_dir, "hf_quant_config.json")
    if not os.path.exists(path):
        return None, ""
    data = load_json(path, "hf_quant_config.json")
    return {"quant_method": "modelopt", **(data.get("quantization") or {})}, path


def quantization_config(config: dict, file: str = "config.json") -> dict | None:
    """The checkpoint's quantization_config (older compressed-tensors exports call it compression_config)."""
    for key in ("quantization_config", "compression_config"):
        qc = config.get(key)
        if qc is not None and not isinstance(qc, dict):  # else read as unquantized: packed codes as weights
            raise CheckpointError(f"config.json field {key!r} must be an object, got {qc!r}", file=file)
        if qc:
            return qc
    return None


def head_dim(config: dict) -> int | None:
    """As the model will have it: config.json's, else the architecture's default (Qwen3: 128), else
    hidden_size // num_attention_heads."""
    from radiance.models.arch_config import head_counts

    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    given = head_counts(config, heads or 1)[1]
    if given:
        return int(given)
    return hidden // heads if hidden and heads and not hidden % heads else None


def expected_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of a Llama/Qwen-style decoder layer, by leaf name ({} if unknown)."""
    from radiance.models.arch_config import head_counts, named_architectures

    hidden = config.get("hidden_size")
    heads = config.get("num_attention_heads")
    inter = config.get("intermediate_size") or config.get("moe_intermediate_size")  # Qwen3.5-MoE: experts only
    hd = head_dim(config)
    if not (hidden and heads and hd and inter):
        return {}
    kv_heads = head_counts(config, heads)[0]
    expert = config.get("moe_intermediate_size")
    if config.get("intermediate_size_mlp"):  # Llama 4: the dense MLPs' size; intermediate_size is the experts'
        inter, expert = config["intermediate_size_mlp"], inter
    if heads % kv_heads:
        return {}  # heads that cannot split: the model registry names the config error, not a shape
    q, kv = heads * hd, kv_heads * hd
    shapes = {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
        "qkv_proj": (q + 2 * kv, hidden), "gate_up_proj": (2 * inter, hidden),  # Phi-3 stores them merged
    }
    hybrid = [name for name in named_architectures(config) if name in LINEAR_ATTENTION_LINEARS]
    if hybrid:
        shapes.update(_hybrid_shapes(config, hidden, q, kv))
    if config.get("vocab_size"):  # without it the model config names the missing key (not an [0, K] shape)
        shapes["lm_head"] = (config["vocab_size"], hidden)
    if expert:  # a sparse MLP's experts, keyed "experts.<leaf>" (hf_reader.HfCheckpoint._expected)
        shapes.update({"experts.gate_proj": (expert, hidden), "experts.up_proj": (expert, hidden),
                       "experts.down_proj": (hidden, expert)})
    return shapes


def _hybrid_shapes(config: dict, hidden: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    """Qwen3.5's and Qwen3-Next's q_proj, which gives each head a gate beside its query, and their linear-attention
    projections (keyed "linear_attn.<leaf>"; none where the config's sizes are wrong: the model registry names that)."""
    from radiance.errors import ConfigError
    from radiance.models.qwen3_5 import linear_attention_config

    shapes = {"q_proj": (2 * q, hidden), "qkv_proj": (2 * q + 2 * kv, hidden)}
    try:
        la = linear_attention_config(config)
    except ConfigError:
        return shapes
    heads, value = la.num_value_heads, la.value_size
    for leaf, rows in (("in_proj_qkv", la.conv_channels), ("in_proj_z", value), ("in_proj_b", heads),
                       ("in_proj_a", heads), ("in_proj_qkvz", la.conv_channels + value), ("in_proj_ba", 2 * heads)):
        shapes[f"linear_attn.{leaf}"] = (rows, hidden)
    shapes["linear_attn.out_proj"] = (hidden, value)
    return shapes


def eos_token_ids(model_dir: str, config: dict, warn=None) -> list[int]:
    """EOS ids from generation_config.json (it may list several), else from config.json. An id outside the
    vocabulary is dropped and `warn(message)` told, as llama.cpp drops a GGUF's: the model cannot produce it."""
    ids, source = None, os.path.join(model_dir, "generation_config.json")
    if os.path.exists(source):
        ids = load_json(source, "generation_config.json").get("eos_token_id")
    if ids is None:
        ids, source = config.get("eos_token_id"), os.path.join(model_dir, "config.json")
    if ids is None:
        return []
    try:
        ids = [int(i) for i in (ids if isinstance(ids, list) else [ids])]
    except (TypeError, ValueError):
        raise CheckpointError(f"eos_token_id must be a token id or a list of them, got {ids!r}", file=source) from None
    return _inside_vocab(ids, config.get("vocab_size"), source, warn or (lambda message: None))


def _inside_vocab(ids: list[int], vocab: int | None, source: str, warn) -> list[int]:
    """`ids` less those the model cannot produce, each of which `warn` is told of, naming the file."""
    kept = []
    for i in ids:
        if i >= 0 and (vocab is None or i < vocab):
            kept.append(i)
            continue
        where = f"outside the vocabulary of {vocab} tokens" if vocab is not None else "negative"
        warn(f"{os.path.basename(source)} eos_token_id {i} is {where}: generation does not end at it (file {source})")
    return kept


def chat_template(model_dir: str) -> str | None:
    """The chat template a model ships (its "default" one; with named templates only, the first)."""
    templates = chat_templates(model_dir)
    return templates.get("default") or next(iter(templates.values()), None)


def chat_templates(model_dir: str) -> dict[str, str]:
    """Every chat template a model ships, by name: "default" from chat_template.jinja, chat_template.json or
    tokenizer_config.json (a string there, or the "default" entry of a list of {name, template}), and named
    ones (tool_use, ...) from that list or from additional_chat_templates/NAME.jinja, where transformers'
    save_pretrained writes them."""
    return {name: text for name, (text, _) in chat_template_files(model_dir).items()}


def chat_template_files(model_dir: str) -> dict[str, tuple[str, str]]:
    """chat_templates with the file each was read from: name -> (template, path)."""
    templates: dict[str, tuple[str, str]] = {}
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as handle:
            templates["default"] = (handle.read(), jinja)
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            continue
        template = load_json(path, name).get("chat_template")
        if isinstance(template, list):
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                       for t in template):
                raise CheckpointError("chat_template, a list, must hold {\"name\": ..., \"template\": ...} "
                                      "objects with text values", file=path)
            for entry in template:
                if entry["template"]:
                    templates.setdefault(entry["name"], (entry["template"], path))
        elif isinstance(template, str):
            if template:
                templates.setdefault("default", (template, path))
        elif template is not None:  # a number: transformers' tokenizer kept it, and jinja failed on it later
            raise CheckpointError(f"chat_template must be text (a jinja template) or a list of {{name, template}}, "
                                  f"got {type(template).__name__}", file=path)
    extra = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra):
        for file in sorted(os.listdir(extra)):
            if file.endswith(".jinja"):
                path = os.path.join(extra, file)
                with open(path, encoding="utf-8") as handle:
                    templates.setdefault(file.removesuffix(".jinja"), (handle.read(), path))
    return templates
