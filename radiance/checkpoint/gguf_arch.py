"""What a GGUF file of each architecture radiance reads means in transformers' terms: its model class and
model_type, llama.cpp's tensor names, the conventions llama.cpp's converter applied (Llama's q/k rows permuted into
its rotary layout; Gemma's norm weights stored as 1 + weight; Phi-3's merged qkv and gate | up kept merged; OLMo 2's
q / k norms over all heads), and the
config fields its metadata leaves to llama.cpp's own defaults (Gemma 3's local rope base, window pattern and query
scale) or spells its own way (Phi-3's pretraining context and window; OLMo 3, an olmo2 file with a window)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from radiance.checkpoint.names import canonical_linear, partition_modules

TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a sparse MLP's router (its experts: gguf_reader's stacked tensors)
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",  # Llama attention_bias
}
# Gemma's four norms per layer: ffn_norm is the one before the MLP, two more norm the attention and MLP outputs
_GEMMA_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


# a block tensor's transform: (HF block name, the function from its float32 values, HF-shaped, to that tensor's)
Derived = tuple[str, Callable[[Any], Any]]


@dataclass(frozen=True)
class DerivedTensor:
    """A GGUF reader's plan entry read through a value transform (GgufArch.derived): the GGUF tensor `name`,
    dequantized to float32 in transformers' [rows, cols] order, then `transform`."""

    name: str
    transform: Callable[[Any], Any]


def ref_name(ref) -> str:
    """The GGUF tensor a plan entry reads: a name, (name, expert) or a DerivedTensor."""
    return ref if isinstance(ref, str) else ref.name if isinstance(ref, DerivedTensor) else ref[0]


@dataclass(frozen=True)
class GgufArch:
    architecture: str  # the transformers class the file's model is
    model_type: str
    permuted_qk: bool = False  # llama.cpp's converter permuted the q / k rows (Llama only)
    norm_shift: float = 0.0  # added to every norm weight by llama.cpp's converter (Gemma: 1, its 1 + weight)
    block_names: dict[str, str] = field(default_factory=dict)  # over BLOCK_NAMES
    hidden_act: str = "silu"
    whole_width_qk_norm: bool = False  # attn_q_norm / attn_k_norm span all heads (OLMo 2), not one head
    extra_config: Callable[[Callable[[str, Any], Any], dict], dict] | None = None  # (field getter, config) -> keys
    # (block tensor suffix, config) -> the HF tensors it becomes through a value transform, or None: read as stored
    derived: Callable[[str, dict], list[Derived] | None] | None = None
    # norm weights llama.cpp's converter did not shift (Qwen3.5's gated ssm_norm among its 1 + weight norms)
    unshifted_norms: tuple[str, ...] = ()

    def block_name(self, suffix: str) -> str | None:
        return self.block_names.get(suffix, BLOCK_NAMES.get(suffix))

    @property
    def all_block_names(self) -> dict[str, str]:
        return {**BLOCK_NAMES, **self.block_names}

# OLMo 2: only the attention's and the MLP's outputs are normed
_OLMO2_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Qwen2-MoE's shared expert and the sigmoid gate that scales it
_QWEN2MOE_SHARED = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# Llama 4's shared expert (no gate: it adds to every token as it is)
_LLAMA4_SHARED = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# GLM-4.5: the norm before the MLP, the router's correction bias, the ungated shared expert
_GLM4MOE_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                  "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", **_LLAMA4_SHARED}
# gpt-oss: the norm before the MLP, the attention's sinks, the router (with a bias)
_GPT_OSS_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                  "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
                  "ffn_gate_inp.bias": "mlp.router.bias"}
# Phi-3: llama.cpp keeps the checkpoint's merged projections (ffn_up holds gate | up, as gate_up_proj does)
_PHI3_MERGED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}


# Qwen3.5 / Qwen3-Next (llama.cpp's qwen35, qwen35moe, qwen3next): the linear-attention layers' tensors as Qwen3.5's
# projections (llama.cpp's converter regroups Qwen3-Next's in_proj_qkvz into attn_qkv and attn_gate itself)
_HYBRID_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
                 "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                 "ssm_out.weight": "linear_attn.out_proj.weight", "ssm_norm.weight": "linear_attn.norm.weight",
                 "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                 "ssm_conv1d.weight": "linear_attn.conv1d.weight", **_QWEN2MOE_SHARED}


def _hybrid_config(arch: str) -> Callable[[Callable[[str, Any], Any], dict], dict]:
    """The config of a qwen35 / qwen35moe / qwen3next file: the linear attention's sizes from llama.cpp's ssm.* keys
    (group_count: key heads, time_step_rank: value heads, state_size: key head dim, inner_size: all value dims),
    every full_attention_interval-th layer attending (4), the experts' sizes; qwen35's block_count counts its
    multi-token-prediction blocks (nextn_predict_layers, not read). A qwen3next file is served with Qwen3.5-MoE's
    layers: its converter wrote Qwen3.5's projections, and its router renormalizes, as Qwen3-Next's."""
    def config(field_of: Callable[[str, Any], Any], base: dict) -> dict:
        value_heads = int(field_of(f"{arch}.ssm.time_step_rank", 0)) or None
        inner = field_of(f"{arch}.ssm.inner_size", None)
        nextn = int(field_of(f"{arch}.nextn_predict_layers", 0))
        if not 0 <= nextn < base["num_hidden_layers"]:
            raise ValueError(f"{arch}.nextn_predict_layers {nextn} of {base['num_hidden_layers']} blocks")
        layers = base["num_hidden_layers"] - nextn
        interval = int(field_of(f"{arch}.full_attention_interval", 4))
        if interval < 1:
            raise ValueError(f"{arch}.full_attention_interval must be at least 1, got {interval}")
        extra = {"num_hidden_layers": layers, "num_nextn_predict_layers": nextn,
                 "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(layers)],
                 "linear_num_key_heads": field_of(f"{arch}.ssm.group_count", None),
                 "linear_num_value_heads": value_heads,
                 "linear_key_head_dim": field_of(f"{arch}.ssm.state_size", None),
                 "linear_value_head_dim": inner // value_heads if inner and value_heads else None,
                 "linear_conv_kernel_dim": field_of(f"{arch}.ssm.conv_kernel", None), "num_local_experts": None}
        if arch == "qwen35":
            return extra
        return {**extra, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                "num_experts": field_of(f"{arch}.expert_count", None),
                "num_experts_per_tok": field_of(f"{arch}.expert_used_count", None),
                "moe_intermediate_size": field_of(f"{arch}.expert_feed_forward_length", None),
                "shared_expert_intermediate_size": field_of(f"{arch}.expert_shared_feed_forward_length", None)}
    return config


def _value_head_order(config: dict) -> Any:
    """For each value head in transformers' order, where a qwen35 file holds it: llama.cpp's converter tiles the
    value heads (file head j * key_heads + g is transformers' head g * per_group + j, so that ggml broadcasts the key
    heads over them), where they are grouped by key head."""
    import torch

    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    per_group = value_heads // key_heads
    return torch.tensor([(h % per_group) * key_heads + h // per_group for h in range(value_heads)])


def _heads_in_order(x: Any, order: Any, dim: int = 0) -> Any:
    """x with its value heads (equal slices along `dim`) taken in `order`."""
    heads = x.unflatten(dim, (len(order), -1))
    return heads.index_select(dim, order.to(x.device)).flatten(dim, dim + 1)


def _hybrid_derived(reorder: bool) -> Callable[[str, dict], list[Derived] | None]:
    """The linear-attention tensors llama.cpp's converter stored transformed: ssm_a = -exp(A_log), the conv squeezed
    to [channels, kernel], qwen3next's ssm_ba (b and a interleaved per key head) split into in_proj_b and in_proj_a,
    the shared expert's gate as a vector; with `reorder` (qwen35, qwen35moe) the value heads tiled
    (_value_head_order) in every tensor that has them, put back in transformers' order."""
    import torch

    def derived(suffix: str, config: dict) -> list[Derived] | None:
        order = _value_head_order(config) if reorder and config.get("linear_num_value_heads") else None
        heads = (lambda x, dim=0: _heads_in_order(x, order, dim)) if order is not None else (lambda x, dim=0: x)
        keys = 2 * (config.get("linear_num_key_heads") or 0) * (config.get("linear_key_head_dim") or 0)
        if suffix == "ssm_a":
            return [("linear_attn.A_log", lambda x: heads(torch.log(-x)))]
        if suffix == "ssm_conv1d.weight":  # q, k channels as stored; the value channels by head
            return [("linear_attn.conv1d.weight",
                     lambda x: torch.cat((x[:keys], heads(x[keys:]))).unsqueeze(1))]
        if suffix == "ffn_gate_inp_shexp.weight":
            return [("mlp.shared_expert_gate.weight", lambda x: x.reshape(1, -1))]
        if suffix == "ssm_ba.weight":  # qwen3next: per key head [b (per_group rows), a (per_group rows)]
            groups = config["linear_num_key_heads"]
            return [("linear_attn.in_proj_b.weight", lambda x: x.unflatten(0, (groups, 2, -1))[:, 0].flatten(0, 1)),
                    ("linear_attn.in_proj_a.weight", lambda x: x.unflatten(0, (groups, 2, -1))[:, 1].flatten(0, 1))]
        if order is None:
            return None
        if suffix == "attn_qkv.weight":
            return [("linear_attn.in_proj_qkv.weight", lambda x: torch.cat((x[:keys], heads(x[keys:]))))]
        if suffix in ("attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
            return [(_HYBRID_NAMES[suffix], heads)]
        if suffix == "ssm_out.weight":  # its columns read the value heads
            return [("linear_attn.out_proj.weight", lambda x: heads(x, 1))]
        return None
    return derived


def _gemma3_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """What llama.cpp takes for Gemma 3 where the metadata is silent: a local rope base of 10000, full attention on
    every 6th layer, and the query scale of transformers' query_pre_attn_scalar (hidden / heads on the 27B, its 62
    layers, else head_dim)."""
    scalar = field_of("gemma3.attention.scale", None)
    if scalar is None:
        big = config["num_hidden_layers"] == 62
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    else:  # llama.cpp's f_attention_scale multiplies q: the scalar whose inverse square root it is
        query_pre_attn_scalar = 1.0 / float(scalar) ** 2
    return {"sliding_window": field_of("gemma3.attention.sliding_window", 4096),
            "sliding_window_pattern": int(field_of("gemma3.attention.sliding_window_pattern", 6)),
            "rope_local_base_freq": float(field_of("gemma3.rope.freq_base_swa", 10000.0)),
            "query_pre_attn_scalar": query_pre_attn_scalar}


def _llama_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """A llama file with experts is llama.cpp's Mixtral: every MLP sparse, the top-k renormalized."""
    if not config.get("num_local_experts"):
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_experts_per_tok": field_of("llama.expert_used_count", None)}


def _qwen3moe_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """Qwen3-MoE's experts: every layer sparse (llama.cpp reads no mlp_only_layers), the top-k renormalized as
    llama.cpp does (and the released checkpoints' norm_topk_prob)."""
    return {"num_experts": field_of("qwen3moe.expert_count", None),
            "num_experts_per_tok": field_of("qwen3moe.expert_used_count", None),
            "moe_intermediate_size": field_of("qwen3moe.expert_feed_forward_length", None), "norm_topk_prob": True}


def _qwen2moe_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """Qwen2-MoE's experts and its gated shared expert: every layer sparse, the top-k not renormalized (llama.cpp's
    and Qwen2MoeConfig's norm_topk_prob false)."""
    return {"num_experts": field_of("qwen2moe.expert_count", None),
            "num_experts_per_tok": field_of("qwen2moe.expert_used_count", None),
            "moe_intermediate_size": field_of("qwen2moe.expert_feed_forward_length", None),
            "shared_expert_intermediate_size": field_of("qwen2moe.expert_shared_feed_forward_length", None),
            "norm_topk_prob": False}


def _gpt_oss_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """gpt-oss: experts of expert_feed_forward_length, its window (128 unless given), and transformers' GptOssConfig
    rope, YaRN without truncating the correction range (llama.cpp writes the type, factor and original context)."""
    return {"intermediate_size": field_of("gpt-oss.expert_feed_forward_length", config["intermediate_size"]),
            "num_experts_per_tok": field_of("gpt-oss.expert_used_count", None),
            "sliding_window": field_of("gpt-oss.attention.sliding_window", 128),
            "rope_parameters": {**config["rope_parameters"], "truncate": False}}


def _llama4_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """Llama 4 as llama.cpp reads it: experts of expert_feed_forward_length (the file's feed_forward_length is the
    dense layers' MLP, intermediate_size_mlp), every interleave_moe_layer_step-th layer sparse, q / k head norms
    except on the 128-expert model (Maverick). Unless the file's attention.sliding_window is 0 (then every layer
    rotates and attends to the whole context), llama.cpp's constants: 8192-token chunks on three layers in four,
    the fourth without rotary and with the query temperature (floor 8192, scale 0.1)."""
    experts = field_of("llama4.expert_count", None)
    extra = {"num_local_experts": experts, "num_experts_per_tok": field_of("llama4.expert_used_count", None),
             "intermediate_size": field_of("llama4.expert_feed_forward_length", None),
             "intermediate_size_mlp": config["intermediate_size"],
             "interleave_moe_layer_step": int(field_of("llama4.interleave_moe_layer_step", 1)),
             "use_qk_norm": experts != 128}
    if field_of("llama4.attention.sliding_window", None) == 0:
        return {**extra, "attention_chunk_size": None, "attn_temperature_tuning": False,
                "no_rope_layers": [1] * config["num_hidden_layers"]}
    return {**extra, "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "attn_temperature_tuning": True,
            "floor_scale": 8192, "attn_scale": 0.1}


# llama.cpp's expert_gating_func values
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def _glm4moe_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """GLM-4.5 as llama.cpp's converter writes it: block_count counts the multi-token-prediction layers too
    (nextn_predict_layers, not served), the experts' sizes, shared count, leading dense layers, routed scaling and
    groups under their llama.cpp names; the router must be the sigmoid one (expert_gating_func 2)."""
    gating = field_of("glm4moe.expert_gating_func", _SIGMOID_GATING)
    if gating != _SIGMOID_GATING:
        raise ValueError(f"glm4moe.expert_gating_func is {gating}: radiance serves GLM-4.5's sigmoid router ("
                         f"{_SIGMOID_GATING}) only")
    nextn = int(field_of("glm4moe.nextn_predict_layers", 0))
    if not 0 <= nextn < config["num_hidden_layers"]:
        raise ValueError(f"glm4moe.nextn_predict_layers {nextn} of {config['num_hidden_layers']} blocks")
    return {"num_hidden_layers": config["num_hidden_layers"] - nextn, "num_nextn_predict_layers": nextn,
            "num_local_experts": None, "n_routed_experts": field_of("glm4moe.expert_count", None),
            "num_experts_per_tok": field_of("glm4moe.expert_used_count", None),
            "moe_intermediate_size": field_of("glm4moe.expert_feed_forward_length", None),
            "n_shared_experts": field_of("glm4moe.expert_shared_count", 1),
            "first_k_dense_replace": field_of("glm4moe.leading_dense_block_count", 1),
            "routed_scaling_factor": float(field_of("glm4moe.expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(field_of("glm4moe.expert_weights_norm", True)),
            "n_group": field_of("glm4moe.expert_group_count", 1),
            "topk_group": field_of("glm4moe.expert_group_used_count", 1)}


def _gemma2_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """Gemma 2's soft caps and window from the metadata; the query scale llama.cpp computes (hidden / heads on the
    27B, its 46 layers, else head_dim), sliding and full layers alternating as in transformers."""
    big = config["num_hidden_layers"] == 46
    scalar = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    return {"attn_logit_softcapping": field_of("gemma2.attn_logit_softcapping", 50.0),
            "final_logit_softcapping": field_of("gemma2.final_logit_softcapping", 30.0),
            "sliding_window": field_of("gemma2.attention.sliding_window", 4096), "query_pre_attn_scalar": scalar}


def _granite_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """Granite's four multipliers, which llama.cpp's converter renames (attention_multiplier -> attention.scale,
    embedding_multiplier -> embedding_scale, residual_multiplier -> residual_scale, logits_scaling -> logit_scale)."""
    keys = {"attention_multiplier": "granite.attention.scale", "embedding_multiplier": "granite.embedding_scale",
            "residual_multiplier": "granite.residual_scale", "logits_scaling": "granite.logit_scale"}
    return {hf: float(field_of(key, 1.0)) for hf, key in keys.items()}


def _olmo2_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """llama.cpp writes OLMo 3 as an olmo2 file with a window: its converter's sliding_window_pattern is one bool per
    layer (true: sliding; llama.cpp's newer loader also takes a period n, n - 1 sliding layers to one full), absent
    it every 4th layer is full. The sliding layers rotate with the plain rope of rope.freq_base_swa, or of
    rope.freq_base, as llama.cpp's graph does; the full ones with the file's scaling (YaRN on the long-context
    models)."""
    window = field_of("olmo2.attention.sliding_window", None)
    if not window:
        return {}
    layers = config["num_hidden_layers"]
    pattern = field_of("olmo2.attention.sliding_window_pattern", 4)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"olmo2.attention.sliding_window_pattern lists {len(pattern)} layers of {layers}")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    local_theta = float(field_of("olmo2.rope.freq_base_swa", config["rope_theta"]))
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": int(window),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {"full_attention": config["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}}


def _phi3_config(field_of: Callable[[str, Any], Any], config: dict) -> dict:
    """The window llama.cpp's converter writes from config.json's sliding_window (on every layer in transformers'
    Phi3), and the pretraining context LongRoPE scales from (rope.scaling.original_context_length)."""
    extra = {}
    window = field_of("phi3.attention.sliding_window", None)
    if window:
        extra["sliding_window"] = int(window)
    original = field_of("phi3.rope.scaling.original_context_length", None)
    if original:
        extra["original_max_position_embeddings"] = int(original)
    return extra


ARCHITECTURES = {
    "llama": GgufArch("LlamaForCausalLM", "llama", permuted_qk=True, extra_config=_llama_config),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", extra_config=_qwen3moe_config),
    # llama.cpp's converter keeps Llama 4's q / k rows as stored (its rope rotates interleaved pairs, as the model)
    "llama4": GgufArch("Llama4ForCausalLM", "llama4_text", block_names=_LLAMA4_SHARED, extra_config=_llama4_config),
    # its rope rotates the two halves of each head's leading dims (NEOX): q / k rows as stored
    "glm4moe": GgufArch("Glm4MoeForCausalLM", "glm4_moe", block_names=_GLM4MOE_NAMES, extra_config=_glm4moe_config),
    "qwen2moe": GgufArch("Qwen2MoeForCausalLM", "qwen2_moe", block_names=_QWEN2MOE_SHARED,
                         extra_config=_qwen2moe_config),
    "gpt-oss": GgufArch("GptOssForCausalLM", "gpt_oss", block_names=_GPT_OSS_NAMES,
                        extra_config=_gpt_oss_config),
    "granite": GgufArch("GraniteForCausalLM", "granite", permuted_qk=True, extra_config=_granite_config),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", norm_shift=1.0, block_names=_GEMMA_NORMS,
                       hidden_act="gelu_pytorch_tanh", extra_config=_gemma2_config),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", norm_shift=1.0, block_names=_GEMMA_NORMS,
                       hidden_act="gelu_pytorch_tanh", extra_config=_gemma3_config),
    "olmo2": GgufArch("Olmo2ForCausalLM", "olmo2", block_names=_OLMO2_NORMS, whole_width_qk_norm=True,
                      extra_config=_olmo2_config),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", block_names=_PHI3_MERGED, extra_config=_phi3_config),
    # SmolLM3: llama.cpp's converter is Llama's (q / k permuted); it writes no NoPE layers and llama.cpp takes
    # every 4th, SmolLM3Config's default interval
    "smollm3": GgufArch("SmolLM3ForCausalLM", "smollm3", permuted_qk=True),
    # every norm of 1 + weight stored so, but the gated ssm_norm; q / k rows as stored (NEOX rope, of a quarter of
    # each head; qwen35's multimodal rope is that rope for text)
    "qwen35": GgufArch("Qwen3_5ForCausalLM", "qwen3_5_text", norm_shift=1.0, block_names=_HYBRID_NAMES,
                       extra_config=_hybrid_config("qwen35"), derived=_hybrid_derived(reorder=True),
                       unshifted_norms=("linear_attn.norm.weight",)),
    "qwen35moe": GgufArch("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", norm_shift=1.0, block_names=_HYBRID_NAMES,
                          extra_config=_hybrid_config("qwen35moe"), derived=_hybrid_derived(reorder=True),
                          unshifted_norms=("linear_attn.norm.weight",)),
    "qwen3next": GgufArch("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", norm_shift=1.0, block_names=_HYBRID_NAMES,
                          extra_config=_hybrid_config("qwen3next"), derived=_hybrid_derived(reorder=False),
                          unshifted_norms=("linear_attn.norm.weight",)),
}


def gguf_name(hf_tensor: str, arch: str = "llama") -> str | None:
    """HF tensor name -> the GGUF name llama.cpp's converter writes it under (None when there is none)."""
    known = ARCHITECTURES.get(arch, ARCHITECTURES["llama"])
    for gguf, hf in TOP_NAMES.items():
        if hf == hf_tensor:
            return gguf
    parts = hf_tensor.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for suffix, block in known.all_block_names.items():
            if block == parts[3] and known.block_name(suffix) == block:
                return f"blk.{parts[2]}.{suffix}"
    return None


def missing_part(module: str, leaf: str, indices: set[int], written_as: str, arch: str
                 ) -> tuple[str, str, str] | None:
    """(HF name, GGUF name, the parts needed) of the first part of merged linear `module` (qkv_proj, gate_up_proj)
    whose `leaf` tensor the file lacks, given the partition `indices` it holds and one GGUF tensor `written_as` of
    it; None when whole, or when the file stores it fused (Phi-3's attn_qkv) or as stacked experts."""
    stored = (hf_name(written_as, arch) or "").rpartition(".")[0]
    projections = partition_modules(module)
    if canonical_linear(stored)[0] == stored or len(projections) < 2:
        return None
    for index, projection in enumerate(projections):
        if index not in indices:
            hf = f"{projection}{leaf}"
            return hf, gguf_name(hf, arch) or hf, ", ".join(p.rpartition(".")[2] for p in projections)
    return None


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> HF tensor name (None for tensors radiance does not use, e.g. rope_freqs)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    known = ARCHITECTURES.get(arch, ARCHITECTURES["llama"])
    if len(parts) == 3 and parts[0] == "blk" and known.block_name(parts[2]) is not None:
        return f"model.layers.{parts[1]}.{known.block_name(parts[2])}"
    return None


# the config fields a GGUF's metadata gives: gguf_reader._synthesize_config reads them through config_key, and
# in_gguf_words names them back in a fault; "{arch}" is general.architecture
_CONFIG_KEYS = {
    "hidden_size": "{arch}.embedding_length", "intermediate_size": "{arch}.feed_forward_length",
    "num_hidden_layers": "{arch}.block_count", "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv", "head_dim": "{arch}.attention.key_length",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "rope_theta": "{arch}.rope.freq_base",
    "max_position_embeddings": "{arch}.context_length", "num_local_experts": "{arch}.expert_count",
    "num_experts_per_tok": "{arch}.expert_used_count", "sliding_window": "{arch}.attention.sliding_window",
}


def config_key(field: str, arch: str) -> str:
    """The GGUF metadata key config field `field` is read from (hidden_size: llama.embedding_length)."""
    return _CONFIG_KEYS[field].format(arch=arch)


def in_gguf_words(message: str, arch: str) -> str:
    """A config fault worded for config.json ("config.json field 'rope_theta' ...") in a GGUF's terms: the metadata
    keys the fields it names come from."""
    keys = {name: config_key(name, arch) for name in _CONFIG_KEYS}
    message = re.sub(r"config\.json field '(\w+)'",
                     lambda m: f"GGUF metadata {keys[m[1]]}" if m[1] in keys else f"GGUF metadata for {m[1]!r}",
                     message)
    message = message.replace("config.json of a", "GGUF metadata of a")
    named = [f"{name} is {key}" for name, key in keys.items() if re.search(rf"\b{name}\b", message)]
    return f"{message} ({', '.join(named)})" if named else message
