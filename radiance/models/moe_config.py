"""The sparse MLP layers of a mixture-of-experts model, read from an HF config.json dict as transformers reads it."""

from __future__ import annotations

from dataclasses import dataclass

from radiance.errors import ConfigError
from radiance.kernels.glu import SILU, GluActivation
from radiance.models.config_fields import given, positive


def expert_count(config: dict):
    """config.json's number of routed experts under any of its spellings (Qwen's num_experts, Mixtral's and gpt-oss's
    num_local_experts, GLM-4.5's n_routed_experts); None or 0 for a dense model."""
    return config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")


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
    # Llama 4: the picked expert's sigmoid score scales its input (not its output), and the shared expert has no gate
    scores_scale_input: bool = False
    shared_expert_gated: bool = True
    # GLM-4.5 (DeepSeek-V3's router): sigmoid scores; the experts are picked by score + a learned correction bias
    # within the `top_groups` of `num_groups` expert groups whose two best biased scores sum highest; the routing
    # weights are the unbiased scores (renormalized with norm_topk_prob) times routed_scaling
    sigmoid_grouped: bool = False
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0

    @classmethod
    def from_hf(cls, config: dict, architecture: str, num_layers: int) -> "MoeConfig | None":
        experts = expert_count(config) or 0
        if not experts:
            return None
        if architecture == "Glm4MoeForCausalLM":
            return cls._glm4_moe(config, int(experts), num_layers)
        if config.get("model_type") == "gpt_oss":
            return cls._gpt_oss(config, int(experts), num_layers)
        if architecture == "MixtralForCausalLM":
            return cls._mixtral(config, int(experts), num_layers)
        if architecture == "Llama4ForCausalLM":
            return cls._llama4(config, int(experts), num_layers)
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not config.get(key):
                raise ConfigError(f"config.json of a {architecture} model with {experts} experts lacks {key!r}")
        top_k = _top_k(config, experts)
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        shared = config.get("shared_expert_intermediate_size")
        if shared == 0 and architecture == "Qwen2MoeForCausalLM":
            # transformers still builds a 0-wide shared expert (it adds zeros) and saves its gate
            raise ConfigError("shared_expert_intermediate_size 0 is not supported for Qwen2-MoE (a shared expert "
                              "of no rows; radiance serves one of at least one row)")
        # transformers' Qwen3.5-MoE router always renormalizes its top k (it reads no norm_topk_prob)
        renormalize = architecture == "Qwen3_5MoeForCausalLM" or bool(config.get("norm_topk_prob", False))
        return cls(int(experts), top_k, int(config["moe_intermediate_size"]), renormalize, layers, int(shared or 0))

    @classmethod
    def _mixtral(cls, config: dict, experts: int, num_layers: int) -> "MoeConfig":
        """Mixtral: every MLP is sparse, experts of `intermediate_size`, the top-k of the router's softmax
        renormalized (transformers' MixtralSparseMoeBlock)."""
        if not config.get("intermediate_size"):
            raise ConfigError("config.json of a Mixtral model lacks 'intermediate_size'")
        return cls(experts, _top_k(config, experts), int(config["intermediate_size"]), True,
                   frozenset(range(num_layers)))

    @classmethod
    def _llama4(cls, config: dict, experts: int, num_layers: int) -> "MoeConfig":
        """Llama 4 (transformers' Llama4TextMoe): the router's top logit through a sigmoid scales the token's input
        to that expert, and an ungated shared expert of the experts' size runs on every token; the sparse layers are
        `moe_layers`, else every `interleave_moe_layer_step`-th (Scout: all, Maverick: every second)."""
        if not config.get("intermediate_size"):
            raise ConfigError("config.json of a Llama 4 model lacks 'intermediate_size'")
        top_k = _top_k(config, experts)
        if top_k != 1:
            # each of k experts would take its own scaled copy of the input; the published models route to one
            raise ConfigError(f"num_experts_per_tok={top_k}: radiance serves Llama 4's router with one expert per "
                              "token (num_experts_per_tok 1, as Scout and Maverick)")
        layers = config.get("moe_layers")
        if layers is None:
            step = positive(config, "interleave_moe_layer_step", 1, integer=True)
            layers = range(step - 1, num_layers, step)
        elif not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
            raise ConfigError(f"config.json field 'moe_layers' must list layer indices below {num_layers}, "
                              f"got {layers!r}")
        inter = int(config["intermediate_size"])
        # renormalized, one expert's routing weight is exactly 1: the score is applied to the input instead
        return cls(experts, 1, inter, True, frozenset(layers), shared_expert_size=inter, scores_scale_input=True,
                   shared_expert_gated=False)

    @classmethod
    def _glm4_moe(cls, config: dict, experts: int, num_layers: int) -> "MoeConfig":
        """GLM-4.5 / 4.6 (transformers' Glm4MoeMoE): the first `first_k_dense_replace` layers dense, the rest sparse
        with the grouped sigmoid router (Glm4MoeTopkRouter) and an ungated shared expert of n_shared_experts
        experts' width."""
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not config.get(key):
                raise ConfigError(f"config.json of a GLM-4 MoE model with {experts} experts lacks {key!r}")
        top_k = _top_k(config, experts)
        groups = positive(config, "n_group", 1, integer=True)
        top_groups = positive(config, "topk_group", 1, integer=True)
        if experts % groups or experts // groups < 2:
            raise ConfigError(f"n_group={groups} must divide the {experts} experts into groups of at least 2 (a "
                              "group is scored by its two best experts)")
        if top_groups > groups or top_k > top_groups * (experts // groups):
            raise ConfigError(f"topk_group={top_groups} of n_group={groups} leaves fewer than "
                              f"num_experts_per_tok={top_k} experts to pick from")
        dense = given(config, "first_k_dense_replace", 1)
        if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= num_layers:
            raise ConfigError(f"config.json field 'first_k_dense_replace' must lie in 0..{num_layers}, got {dense!r}")
        inter = int(config["moe_intermediate_size"])
        shared = given(config, "n_shared_experts", 1)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ConfigError(f"config.json field 'n_shared_experts' must be an integer >= 0, got {shared!r}")
        return cls(experts, top_k, inter, bool(given(config, "norm_topk_prob", True)),
                   frozenset(range(dense, num_layers)), shared_expert_size=inter * shared, shared_expert_gated=False,
                   sigmoid_grouped=True, num_groups=groups, top_groups=top_groups,
                   routed_scaling=float(positive(config, "routed_scaling_factor", 1.0)))

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
