"""The architecture facts the models need, read from an HF config.json dict (old and new rope spellings)."""

from __future__ import annotations

from dataclasses import dataclass

from radiance.errors import ConfigError
from radiance.kernels.glu import SILU, GluActivation


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False   # Qwen2
    qk_norm: bool = False    # Qwen3
    moe: "MoeConfig | None" = None  # mixture-of-experts MLPs (Qwen3-MoE)
    o_bias: bool = False     # gpt-oss: o_proj has a bias too
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit joins each softmax denominator
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (itself included)
    sliding_layers: frozenset[int] = frozenset()  # the layers that use it (config.json `layer_types`)

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers

    def window_of(self, index: int) -> int | None:
        """The sliding window of decoder layer `index`, None for full attention."""
        return self.sliding_window if index in self.sliding_layers else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict, architecture: str, **overrides) -> "ArchConfig":
        def need(key):
            if config.get(key) is None:  # a null is as missing as an absent key (it failed later, as a TypeError)
                raise ConfigError(f"config.json of a {architecture} model lacks {key!r}")
            return config[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if config.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: swish is silu
            raise ConfigError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("mlp_bias"):
            raise ConfigError("mlp_bias true is not supported (the MLP projections have no bias in radiance)")
        kv_heads, head_dim = _heads(config, architecture, hidden, heads)
        theta, scaling = _rope(config)
        # Llama's attention_bias: q, k, v and o all carry a bias (as in transformers)
        flags = {"qkv_bias": bool(config.get("attention_bias")), "o_bias": bool(config.get("attention_bias"))}
        flags.update(overrides)
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe=MoeConfig.from_hf(config, architecture, need("num_hidden_layers")),
            **_sliding_window(config, need("num_hidden_layers")),
            **flags,
        )


def _heads(config: dict, architecture: str, hidden: int, heads: int) -> tuple[int, int]:
    """(num_key_value_heads, head_dim): a missing kv count means one per head and a missing head_dim
    hidden_size / heads, as in transformers; grouped-query attention needs heads to split evenly."""
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigError(f"config.json of a {architecture} model: num_attention_heads {heads} is not a multiple "
                          f"of num_key_value_heads {kv_heads}")
    head_dim = config.get("head_dim")
    if not head_dim:
        if hidden % heads:
            raise ConfigError(f"config.json of a {architecture} model gives no head_dim and hidden_size {hidden} "
                              f"is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return kv_heads, head_dim


# rope_type -> the keys its frequencies are computed from (radiance.layers.rotary)
ROPE_TYPES = {"default": (), "linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ("factor",)}


def _rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling`, checked here so that an unsupported or incomplete scaling is one line before any load."""
    rope = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    for key, value in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json {key} must be an object, got {value!r}")
    rope = dict(rope or {})
    theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    scaling = rope or scaling
    partial = (scaling or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial!r} is not supported (radiance rotates whole heads)")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    for key in ROPE_TYPES[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{kind} rope_scaling needs a positive number for {key!r}, got {value!r}")
    # dynamic NTK (transformers) rescales only past max_position_embeddings, which radiance never serves:
    # below it, its frequencies are exactly the default ones
    if kind in ("default", "dynamic"):
        return float(theta), None
    return float(theta), scaling


def _sliding_window(config: dict, num_layers: int) -> dict:
    """sliding_window and the layers that use it: those `layer_types` calls "sliding_attention" (gpt-oss).
    Qwen2/Qwen3 configs carry a `sliding_window` that `use_sliding_window: false` switches off; a window
    switched on without `layer_types` (which layers?) is refused rather than guessed."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if not window or (types is None and not config.get("use_sliding_window")):
        return {}
    if types is None:
        raise ConfigError("config.json turns a sliding window on (use_sliding_window) without layer_types; "
                          "radiance needs layer_types to know which layers use it")
    if len(types) != num_layers:
        raise ConfigError(f"config.json lists {len(types)} layer_types for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)} (supported: sliding_attention, full_attention)")
    return {"sliding_window": int(window),
            "sliding_layers": frozenset(i for i, t in enumerate(types) if t == "sliding_attention")}


@dataclass(frozen=True)
class MoeConfig:
    """Sparse MLP layers: a router picks `top_k` of `num_experts` SwiGLU experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool    # renormalize the top-k router probabilities to sum to 1
    layers: frozenset[int]  # decoder layers whose MLP is sparse; the others are dense
    shared_expert_size: int = 0  # Qwen2-MoE: an always-on expert of this size, scaled by a sigmoid gate
    router_bias: bool = False  # gpt-oss: the router linear has a bias
    expert_bias: bool = False  # gpt-oss: both expert linears have biases
    activation: GluActivation = SILU  # the experts' GLU (gpt-oss: clamped SwiGLU)

    @classmethod
    def from_hf(cls, config: dict, architecture: str, num_layers: int) -> "MoeConfig | None":
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        if not experts:
            return None
        if config.get("model_type") == "gpt_oss":
            return cls._gpt_oss(config, int(experts), num_layers)
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not config.get(key):
                raise ConfigError(f"config.json of a {architecture} model with {experts} experts lacks {key!r}")
        top_k = _top_k(config, experts)
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(int(experts), top_k, int(config["moe_intermediate_size"]),
                   bool(config.get("norm_topk_prob", False)), layers,
                   int(config.get("shared_expert_intermediate_size") or 0))

    @classmethod
    def _gpt_oss(cls, config: dict, experts: int, num_layers: int) -> "MoeConfig":
        """gpt-oss: every MLP is sparse; softmax over the top-k router logits (= the full softmax's top k,
        renormalized); biased experts of `intermediate_size` with the clamped SwiGLU."""
        if not config.get("intermediate_size"):
            raise ConfigError("config.json of a gpt-oss model lacks 'intermediate_size'")
        act = GluActivation("swiglu_oai", alpha=float(config.get("swiglu_alpha", 1.702)),
                            limit=float(config.get("swiglu_limit", 7.0)))
        return cls(experts, _top_k(config, experts), int(config["intermediate_size"]), True,
                   frozenset(range(num_layers)), router_bias=True, expert_bias=True, activation=act)


def _top_k(config: dict, experts: int) -> int:
    top_k = int(config.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must lie in 1..num_experts={experts}")
    return top_k
