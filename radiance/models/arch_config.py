"""The architecture facts the models need, read from an HF config.json dict (old and new rope spellings)."""

from __future__ import annotations

from dataclasses import dataclass

from radiance.errors import ConfigError


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

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict, architecture: str, **overrides) -> "ArchConfig":
        def need(key):
            if key not in config:
                raise ConfigError(f"config.json of a {architecture} model lacks {key!r}")
            return config[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        rope = dict(config.get("rope_parameters") or {})  # transformers >= 5 folds theta into it
        theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
        scaling = rope or config.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe=MoeConfig.from_hf(config, architecture, need("num_hidden_layers")),
            **overrides,
        )


@dataclass(frozen=True)
class MoeConfig:
    """Sparse MLP layers: a router picks `top_k` of `num_experts` SwiGLU experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool    # renormalize the top-k router probabilities to sum to 1
    layers: frozenset[int]  # decoder layers whose MLP is sparse; the others are dense
    shared_expert_size: int = 0  # Qwen2-MoE: an always-on expert of this size, scaled by a sigmoid gate

    @classmethod
    def from_hf(cls, config: dict, architecture: str, num_layers: int) -> "MoeConfig | None":
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        if not experts:
            return None
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not config.get(key):
                raise ConfigError(f"config.json of a {architecture} model with {experts} experts lacks {key!r}")
        top_k = int(config["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must lie in 1..num_experts={experts}")
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(int(experts), top_k, int(config["moe_intermediate_size"]),
                   bool(config.get("norm_topk_prob", False)), layers,
                   int(config.get("shared_expert_intermediate_size") or 0))
