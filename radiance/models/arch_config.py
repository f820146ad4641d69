"""The architecture facts the models need, read from an HF config.json dict (old and new rope spellings)."""

from __future__ import annotations

from dataclasses import dataclass

from radiance.errors import ConfigError
from radiance.kernels.glu import GELU_TANH, GELU_TANH_NAMES, SILU, GluActivation
from radiance.models.config_fields import given, positive
from radiance.models.moe_config import MoeConfig
from radiance.models.rope_config import longrope, read_rope, rotary_dim_of


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5): k / v heads and their sizes, the causal conv's
    width. Each value head keeps a [key_head_dim, value_head_dim] float32 state per sequence instead of a KV cache."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v side by side: the channels the depthwise conv runs over."""
        return 2 * self.key_size + self.value_size


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
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (Qwen2/3-MoE, Mixtral, gpt-oss, Llama 4)
    o_bias: bool = False     # gpt-oss: o_proj has a bias too
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit joins each softmax denominator
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (itself included)
    sliding_layers: frozenset[int] = frozenset()  # the layers that use it (config.json `layer_types`)
    # Gemma 3, OLMo 3: the sliding layers' own rope base (no scaling); None: they rotate as the others do
    sliding_rope_theta: float | None = None
    attention_scale: float | None = None  # Gemma 3: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size); Granite: embedding_multiplier
    embed_scale_rounded: bool = True  # the scale rounded to the model's dtype first (Gemma), or not (Granite)
    residual_multiplier: float = 1.0  # Granite: what each attention and MLP adds to the residual stream is scaled
    logits_scaling: float = 1.0  # Granite: the logits are divided by it
    attn_softcap: float | None = None  # Gemma 2: each attention logit x becomes c * tanh(x / c)
    final_softcap: float | None = None  # Gemma 2: each output logit likewise
    mlp_activation: GluActivation = SILU  # the dense MLP's GLU (Gemma: GeGLU)
    rotary_dim: int | None = None  # Phi-4-mini: the leading dims of each head that rotate; None: all of them
    nope_layers: frozenset[int] = frozenset()  # SmolLM3, Llama 4: layers that attend without rotary positions
    # Llama 4: chunked local attention (a query sees the keys of its own chunk of this many tokens, up to itself) on
    # these layers
    attention_chunk: int | None = None
    chunked_layers: frozenset[int] = frozenset()
    # Llama 4's NoPE layers: each query times 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)),
    # as (floor_scale, attn_scale); None: queries as they are
    query_temperature: tuple[float, float] | None = None
    # Qwen3.5: these layers are Gated DeltaNet linear attention (a recurrent state per sequence, no KV cache)
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: frozenset[int] = frozenset()
    attention_output_gate: bool = False  # Qwen3.5: q_proj also gives a per-head gate, sigmoid(gate) * attention

    @property
    def attention_layer_ids(self) -> list[int]:
        """The decoder layers that attend over the KV cache (all of them but the linear-attention ones), in order:
        model.attention_layers() lists their Attention modules in this order."""
        return [i for i in range(self.num_layers) if i not in self.linear_layers]

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.layers

    def window_of(self, index: int) -> int | None:
        """The sliding window of decoder layer `index`, None for full attention."""
        return self.sliding_window if index in self.sliding_layers else None

    def chunk_of(self, index: int) -> int | None:
        """The attention chunk of decoder layer `index` (Llama 4), None for attention without chunks."""
        return self.attention_chunk if index in self.chunked_layers else None

    @property
    def context_length(self) -> int:
        """Tokens a sequence may span, vLLM's rule: max_position_embeddings, but with YaRN the original context
        times the factor (Qwen3's recipe adds YaRN to config.json to reach 4 x 32k and leaves
        max_position_embeddings at 40960). Linear scaling keeps max_position_embeddings, where such configs
        already give the scaled length (vLLM multiplies it once more); dynamic NTK is served as the default
        rope (see _rope), which transformers matches only up to max_position_embeddings."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn":
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return self.max_position_embeddings

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

        defaults = hf_defaults(architecture)
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if config.get("mlp_bias") and architecture in _READS_MLP_BIAS:
            raise ConfigError("mlp_bias true is not supported (the MLP projections have no bias in radiance)")
        kv_heads, head_dim = _heads(config, architecture, hidden, heads)
        theta, scaling = read_rope(config, defaults, architecture)
        rotary_dim = rotary_dim_of(config, architecture, head_dim)
        max_positions = int(positive(config, "max_position_embeddings", defaults.max_position_embeddings,
                                      integer=True))
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
            scaling = longrope(config, scaling, defaults, rotary_dim or head_dim, max_positions)
        # attention_bias: q, k, v and o all carry a bias (as in transformers' Llama, Qwen3 and gpt-oss)
        bias = bool(given(config, "attention_bias", defaults.attention_bias))
        moe = MoeConfig.from_hf(config, architecture, need("num_hidden_layers"))
        flags = {"qkv_bias": bias, "o_bias": bias}
        if architecture not in _OWN_ACTIVATION:
            flags["mlp_activation"] = _hidden_act(config, moe is not None)
        # (an architecture without dense MLPs gives its own: Qwen3.5-MoE's config has no intermediate_size)
        fields = {} if "intermediate_size" in overrides else dict(intermediate_size=need("intermediate_size"))
        fields.update(flags)
        fields.update(overrides)  # the architecture's own reading of a field wins (Llama 4's dense MLP size)
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=positive(config, "rms_norm_eps", defaults.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            rotary_dim=rotary_dim,
            tie_word_embeddings=bool(given(config, "tie_word_embeddings", defaults.tie_word_embeddings)),
            moe=moe,
            **_sliding_window(config, architecture, need("num_hidden_layers")),
            **fields,
        )


@dataclass(frozen=True)
class HfDefaults:
    """What transformers (its <Model>Config) assumes for a key config.json leaves out, so that such a config
    is served as transformers reads it."""

    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_key_value_heads: int | None = None  # when the key is absent (None, or a null: one per head)
    attention_bias: bool = False
    rope_parameters: dict | None = None  # the rope scaling of a config that gives none
    tie_word_embeddings: bool = False
    original_max_position_embeddings: int | None = None  # LongRoPE's pretraining context when config.json omits it


# gpt-oss's published rope (transformers' GptOssConfig default)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
HF_DEFAULTS = {
    "LlamaForCausalLM": HfDefaults(2048),
    "GraniteForCausalLM": HfDefaults(2048),
    "Gemma2ForCausalLM": HfDefaults(8192, head_dim=256, num_key_value_heads=4, tie_word_embeddings=True),
    "Gemma3ForCausalLM": HfDefaults(131072, rope_theta=1_000_000.0, head_dim=256, num_key_value_heads=4,
                                    tie_word_embeddings=True),
    "MistralForCausalLM": HfDefaults(131072, num_key_value_heads=8),
    "MixtralForCausalLM": HfDefaults(131072, rms_norm_eps=1e-5, rope_theta=1_000_000.0, num_key_value_heads=8),
    "Phi3ForCausalLM": HfDefaults(4096, rms_norm_eps=1e-5, original_max_position_embeddings=4096),
    "Olmo2ForCausalLM": HfDefaults(2048, rms_norm_eps=1e-5),
    "Olmo3ForCausalLM": HfDefaults(2048, rms_norm_eps=1e-5, rope_theta=500000.0),
    "Qwen2ForCausalLM": HfDefaults(32768, num_key_value_heads=32),
    "Qwen2MoeForCausalLM": HfDefaults(32768, num_key_value_heads=16),
    "Qwen3ForCausalLM": HfDefaults(32768, head_dim=128, num_key_value_heads=32),  # not hidden // heads
    "Qwen3MoeForCausalLM": HfDefaults(32768, num_key_value_heads=4),
    "SmolLM3ForCausalLM": HfDefaults(32768, rope_theta=2_000_000.0, num_key_value_heads=4, tie_word_embeddings=True),
    "Llama4ForCausalLM": HfDefaults(131072, rms_norm_eps=1e-5, rope_theta=500000.0, head_dim=128,
                                    num_key_value_heads=8),
    "GptOssForCausalLM": HfDefaults(131072, rms_norm_eps=1e-5, rope_theta=150000.0, head_dim=64,
                                    num_key_value_heads=8, attention_bias=True, rope_parameters=_GPT_OSS_ROPE),
    "Glm4MoeForCausalLM": HfDefaults(131072, rms_norm_eps=1e-5, num_key_value_heads=8),
    "Qwen3_5ForCausalLM": HfDefaults(32768, head_dim=256, num_key_value_heads=4),
    "Qwen3_5MoeForCausalLM": HfDefaults(32768, head_dim=256, num_key_value_heads=2),
    "Qwen3NextForCausalLM": HfDefaults(32768, head_dim=256, num_key_value_heads=2),
}


def hf_defaults(architecture: str) -> HfDefaults:
    """transformers' defaults for `architecture` (a class name); Llama's for one radiance does not know."""
    return HF_DEFAULTS.get(architecture, HF_DEFAULTS["LlamaForCausalLM"])


# model_type -> class, for configs that omit `architectures` (as transformers' AutoModelForCausalLM maps them)
MODEL_TYPES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}


def named_architectures(config: dict) -> list[str]:
    """The class names config.json gives (`architectures`, else the one its `model_type` implies)."""
    names = config.get("architectures") or []
    if not names and config.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[config["model_type"]]]
    return list(names)


def config_defaults(config: dict) -> HfDefaults:
    """transformers' defaults for the architecture this config.json names (Llama's for one radiance does not know)."""
    known = [name for name in named_architectures(config) if name in HF_DEFAULTS]
    return hf_defaults(known[0] if known else "")


def head_counts(config: dict, heads: int) -> tuple[int, int | None]:
    """(num_key_value_heads, head_dim or None for hidden_size // heads) as transformers reads config.json:
    an absent kv count is the architecture's default (Qwen3: 32), a null one one per head."""
    defaults = config_defaults(config)
    kv_heads = config["num_key_value_heads"] if "num_key_value_heads" in config else defaults.num_key_value_heads
    return kv_heads or heads, config.get("head_dim") or defaults.head_dim


def _heads(config: dict, architecture: str, hidden: int, heads: int) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) with transformers' defaults (head_counts); grouped-query attention needs
    heads to split evenly."""
    kv_heads, head_dim = head_counts(config, heads)
    if heads % kv_heads:
        raise ConfigError(f"config.json of a {architecture} model: num_attention_heads {heads} is not a multiple "
                          f"of num_key_value_heads {kv_heads}")
    if not head_dim:
        if hidden % heads:
            raise ConfigError(f"config.json of a {architecture} model gives no head_dim and hidden_size {hidden} "
                              f"is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return kv_heads, head_dim


# architectures whose transformers MLP takes config.json's mlp_bias (radiance's MLPs have no bias)
_READS_MLP_BIAS = {"LlamaForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM"}

# architectures whose MLP activation is not hidden_act's: Gemma reads hidden_activation (gemma_overrides), gpt-oss's
# experts always use its clamped SwiGLU (transformers' gpt-oss never reads hidden_act)
_OWN_ACTIVATION = {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"}

def _hidden_act(config: dict, moe: bool) -> GluActivation:
    """config.json's hidden_act as the dense MLP's GLU: silu (swish is its old name) or, on dense MLPs only,
    transformers' gelu_pytorch_tanh (a GeGLU, as Gemma's); the experts' kernels take silu only here."""
    act = config.get("hidden_act", "silu")
    if act in ("silu", "swish"):
        return SILU
    if act in GELU_TANH_NAMES and not moe:
        return GELU_TANH
    only = "silu" if moe else "silu or gelu_pytorch_tanh"
    raise ConfigError(f"hidden_act {act!r} is not supported{' for a mixture-of-experts model' if moe else ''} "
                      f"(only {only})")


def _sliding_window(config: dict, architecture: str, num_layers: int) -> dict:
    """sliding_window and the layers that use it, as transformers reads them: Llama has none; Qwen2, Qwen3 and
    their MoE variants only with `use_sliding_window` (off, transformers nulls sliding_window whatever
    layer_types says), on the layers `layer_types` calls "sliding_attention" or, without it, the ones
    `max_window_layers` implies; gpt-oss on the sliding layers of its `layer_types`, without them on the even
    layers (window 128 unless given), as transformers' GptOssConfig derives them; Mistral on every layer (4096
    unless given; a null window is full attention); Phi-3 on every layer when given; OLMo 3 on three layers of four
    (4096 unless given); SmolLM3 only with `use_sliding_window`, on its NoPE layers."""
    if architecture in _QWEN_SLIDING_LAYERS:
        if not config.get("use_sliding_window"):
            return {}
        window = config.get("sliding_window", 4096)  # transformers' default
    elif architecture == "GptOssForCausalLM":
        # transformers' GptOssConfig: an absent window is 128, a null one none; use_sliding_window is not read
        window = config.get("sliding_window", 128)
    elif architecture == "MistralForCausalLM":
        # transformers' MistralConfig: an absent window is 4096 (Mistral-7B v0.1's), a null one none (v0.2 on)
        window = config.get("sliding_window", 4096)
    elif architecture == "MixtralForCausalLM":
        window = config.get("sliding_window")  # transformers' MixtralConfig: none unless given
    elif architecture == "Phi3ForCausalLM":
        window = config.get("sliding_window")  # transformers' Phi3Config: none unless given
    elif architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        window = config.get("sliding_window", 4096)  # transformers' Gemma2Config, Gemma3TextConfig
    elif architecture == "Olmo3ForCausalLM":
        window = config.get("sliding_window", 4096)  # transformers' Olmo3Config
    elif architecture == "SmolLM3ForCausalLM":
        if not config.get("use_sliding_window"):
            return {}
        window = config.get("sliding_window")  # transformers' SmolLM3Config: none unless given
    else:
        return {}
    if not window:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json field 'sliding_window' must be a positive integer, got {window!r}")
    layers = frozenset(i for i, t in enumerate(_layer_types(config, architecture, num_layers))
                       if t == "sliding_attention")
    return {"sliding_window": window, "sliding_layers": layers} if layers else {}


def _layer_types(config: dict, architecture: str, num_layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None or architecture in _READS_NO_LAYER_TYPES:
        return [_DERIVED_LAYER_TYPES[architecture](i, config) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        count = len(types) if isinstance(types, list) else repr(types)
        raise ConfigError(f"config.json lists {count} layer_types for {num_layers} layers")
    unknown = set(map(str, types)) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(f"unsupported layer_types {sorted(unknown)} (supported: sliding_attention, full_attention)")
    return types


def _max_window_layers(config: dict) -> int:
    value = given(config, "max_window_layers", 28)  # transformers' default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json field 'max_window_layers' must be a layer count, got {value!r}")
    return value


def _slides_from_max_window_layers(layer: int, config: dict) -> str:
    return "sliding_attention" if layer >= _max_window_layers(config) else "full_attention"


def _slides_on_even_layers_below(layer: int, config: dict) -> str:
    return "sliding_attention" if layer % 2 == 0 and layer < _max_window_layers(config) else "full_attention"


def _slides_on_even_layers(layer: int, config: dict) -> str:
    return "sliding_attention" if layer % 2 == 0 else "full_attention"


# the layer type transformers gives layer i of a config.json with no layer_types (its <Model>Config):
# Qwen2 / Qwen3 slide from max_window_layers on, Qwen2-MoE on the even layers below it, Qwen3-MoE everywhere
_QWEN_SLIDING_LAYERS = {
    "Qwen2ForCausalLM": _slides_from_max_window_layers,
    "Qwen3ForCausalLM": _slides_from_max_window_layers,
    "Qwen2MoeForCausalLM": _slides_on_even_layers_below,
    "Qwen3MoeForCausalLM": lambda layer, config: "sliding_attention",
}
def _slides_but_every_nth(layer: int, config: dict) -> str:
    """Gemma 3 without layer_types: full attention on every sliding_window_pattern-th layer (6: 5 local, 1 global)."""
    pattern = given(config, "sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"config.json field 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
    return "sliding_attention" if (layer + 1) % pattern else "full_attention"


def _slides_without_rotary(layer: int, config: dict) -> str:
    """SmolLM3 without layer_types: its NoPE layers slide (with use_sliding_window; _sliding_window checks that)."""
    from radiance.models.smollm3 import rotary_layers

    return "full_attention" if rotary_layers(config)[layer] else "sliding_attention"


# gpt-oss and Gemma 2 alternate, starting with a sliding layer; Mistral and Phi-3 slide on every layer, OLMo 3 on three of four
_DERIVED_LAYER_TYPES = {**_QWEN_SLIDING_LAYERS, "GptOssForCausalLM": _slides_on_even_layers,
                        "Gemma3ForCausalLM": _slides_but_every_nth,
                        "Gemma2ForCausalLM": _slides_on_even_layers,
                        "MistralForCausalLM": lambda layer, config: "sliding_attention",
                        "MixtralForCausalLM": lambda layer, config: "sliding_attention",
                        "Phi3ForCausalLM": lambda layer, config: "sliding_attention",
                        "SmolLM3ForCausalLM": _slides_without_rotary,
                        "Olmo3ForCausalLM": lambda layer, config: "full_attention" if (layer + 1) % 4 == 0
                        else "sliding_attention"}
# transformers' Qwen3-MoE, Mistral, Mixtral and Phi-3 read no layer_types: their windows follow the rules above whatever
# it says
_READS_NO_LAYER_TYPES = {"Qwen3MoeForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"}
