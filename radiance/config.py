"""Every knob of radiance as frozen dataclasses.

Each area owns one dataclass; `EngineConfig` bundles the ones the engine needs. Validation lives
in `__post_init__` so a bad value fails where it is built, with the field's name in the message.
radiance.config_cli turns any of these into argparse flags and back, so every field is reachable from the
command line without a hand-written flag per field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from radiance.config_types import check_types as _check_types
from radiance.errors import ConfigError

QUANTIZATIONS = ("auto", "mxfp4", "nvfp4", "none")
RULES = ("mse", "noclip", "ocp")
# "none" only with quantization="nvfp4": serve the NVFP4 weights dequantized (W4A16), no requant
MODEL_RULES = RULES + ("none",)
DTYPES = ("float32", "bfloat16", "float16")
# vLLM's names of the dtypes (`vllm serve ... --dtype half`, LLM(dtype="half")), so that its command lines and calls
# run as they are; auto: the default (bfloat16 on CUDA, float32 on a CPU)
DTYPE_ALIASES = {"half": "float16", "float": "float32", "auto": None}
# a quantized lm_head: one MXFP4 term (4.25 bits per weight) or two (the head, then its residual: 8.5 bits)
LM_HEAD_FORMATS = ("mxfp4", "mxfp4x2")


def _check(cond: bool, msg: str) -> None:
    """Every message names the field, what it takes and the value given (`got ...`): the CLI words it in flags
    (config_cli.in_flag_words), which adds no value of its own to a message that says one."""
    if not cond:
        raise ConfigError(msg)


SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.long's, as the server's request `seed` (and vLLM's) takes


def check_seed(seed: int, name: str) -> None:
    """A seed torch takes: beyond 64 bits torch.manual_seed failed after the checkpoint opened, as "Overflow when
    unpacking long long". Negatives stay valid: torch maps one to seed + 2**64, so -1 and 1 differ."""
    low, high = SEED_RANGE
    _check(low <= seed <= high, f"{name} must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {seed}")


def _check_regexes(patterns: tuple[str, ...], name: str) -> None:
    """Each pattern compiles: a typo is the user's to fix before a model loads, not a traceback halfway through."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{name}: {pattern!r} is not a regular expression: {exc}") from None


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to quantize it."""

    model: str | None = None  # path to an HF directory / GGUF file, or a Hugging Face Hub id (org/name[:TAG]); default: the embedded SmolLM2
    quantization: str = "auto"  # auto: as the checkpoint says (NVFP4/FP8 requantized to MXFP4); mxfp4: also quantize 16-bit linears; nvfp4: quantize 16-bit linears to NVFP4, then serve per --rule; none: dequantize everything to 16 bit
    rule: str = "mse"  # block-exponent rule for any conversion to MXFP4 (mse, noclip, ocp; none = serve NVFP4 dequantized)
    dtype: str | None = None  # activations/16-bit weights; default bfloat16 on CUDA, float32 on a CPU (bfloat16 is up to ~20% faster on some x86 CPUs, none on others, and its greedy answers differ between CPUs)
    device: str | None = None  # "cuda", "cpu", "cuda:1"; default cuda when available
    max_model_len: int | None = None  # tokens of a sequence (prompt and output) at most; default: the model's context (max_position_embeddings, a GGUF's context_length; with YaRN rope scaling its original_max_position_embeddings x factor, as vLLM); a value above the context is refused (no rotary angles past it, so there is no override), one above what the KV cache holds (blocks x block_size) is refused too (raise gpu_memory_utilization / cpu_kv_cache_bytes / num_gpu_blocks_override, or kv_cache_dtype fp8); unset, the context is lowered to the KV cache's capacity with a warning
    ignore: tuple[str, ...] = ()  # regexes (re.search) of linears to serve 16-bit (not quantized at load; one stored quantized dequantized): radiance's names (qkv_proj) or the checkpoint's (q_proj, k_proj, v_proj: a fused linear's parts all or none)
    quantize_lm_head: bool = False  # with quantization mxfp4/nvfp4, quantize a 16-bit lm_head too (a tied one gets a quantized copy; the embedding stays 16-bit)
    lm_head_format: str = "mxfp4"  # with quantize_lm_head: mxfp4 (4.25 bits per weight) or mxfp4x2 (two MXFP4 terms, the head and its residual: 8.5 bits, ~1/8 of the error, one GEMM)
    seed: int = 0  # seed of the torch RNG (random weights, sampling without a per-request seed): a 64-bit signed integer, as a request's seed; a negative one is a seed of its own (torch takes -1 as 2**64 - 1)

    def __post_init__(self):
        _check_types(self)
        _check(self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _check(self.rule in MODEL_RULES, f"rule must be one of {MODEL_RULES}, got {self.rule!r}")
        _check(self.rule != "none" or self.quantization == "nvfp4",
               f"rule 'none' only applies to quantization 'nvfp4', got quantization {self.quantization!r} (with "
               "quantization nvfp4, rule none serves NVFP4 weights, a checkpoint's or 16-bit ones quantized at load, "
               "dequantized as W4A16)")
        _check(self.dtype is None or self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len must be positive, got {self.max_model_len!r}")
        check_seed(self.seed, "seed")
        _check_regexes(self.ignore, "ignore")
        _check(not self.quantize_lm_head or self.quantization in ("mxfp4", "nvfp4"),
               "quantize_lm_head needs quantization mxfp4 or nvfp4 (it quantizes a 16-bit head at load), got "
               f"quantization {self.quantization!r}")
        _check(self.lm_head_format in LM_HEAD_FORMATS,
               f"lm_head_format must be one of {LM_HEAD_FORMATS}, got {self.lm_head_format!r}")
        _check(self.lm_head_format == "mxfp4" or self.quantize_lm_head,
               f"lm_head_format {self.lm_head_format!r} applies to a quantized lm_head, got quantize_lm_head off: "
               "add quantize_lm_head")
        _check(self.lm_head_format == "mxfp4" or self.rule != "none",
               "lm_head_format 'mxfp4x2' quantizes to MXFP4: it needs a rule other than 'none' ('mse', 'noclip' or "
               "'ocp'), got rule 'none'")


KV_CACHE_DTYPES = ("auto", "fp8")
ACTIVATIONS = ("fp8", "bf16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16  # tokens per KV cache block
    gpu_memory_utilization: float = 0.9  # fraction of total GPU memory the process may use
    cpu_kv_cache_bytes: int = 512 << 20  # KV budget when running on the CPU (a float32 cache there)
    num_gpu_blocks_override: int | None = None  # force a block count (tests, preemption drills); default: as many as the memory budget holds
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes
    prefix_states: int | None = None  # a model with recurrent state (Qwen3.5): how many prefixes' states its prefix cache keeps (taken where prefill chunks end on a block boundary); default as many as max_num_seqs, 0 turns its prefix caching off
    kv_cache_dtype: str = "auto"  # auto (the model's dtype; float32 on CPU) | fp8 (e4m3, scale 1: half a 16-bit cache's bytes)
    # local layers (a sliding window, Llama 4's chunks) keep their own block tables and give back the pages behind
    # their span (vLLM's hybrid KV cache manager; false: every layer keeps every token's K/V)
    hybrid_kv_cache: bool = True

    def __post_init__(self):
        _check_types(self)
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two, got {self.block_size!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(self.cpu_kv_cache_bytes > 0, f"cpu_kv_cache_bytes must be positive, got {self.cpu_kv_cache_bytes!r}")
        _check(self.prefix_states is None or self.prefix_states >= 0,
               f"prefix_states must be 0 or more, got {self.prefix_states!r}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
               f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64  # sequences decoded together at most
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits above it)
    enable_chunked_prefill: bool = True  # split long prompts across steps so decodes keep running

    def __post_init__(self):
        _check_types(self)
        _check(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs!r}")
        _check(self.max_num_batched_tokens > 0,
               f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels serve the linears and how they are checked."""

    decode_band: int = 64  # M up to this runs the split-K decode kernel, above it the prefill kernel
    use_triton: bool = True  # False forces the torch reference path everywhere
    activations: str = "fp8"  # fp8 = W4A8; bf16 = W4A16 (dequantized weights, 16-bit activations)
    numerics_check: bool = False  # compare served outputs against the fp32 reference while running
    numerics_check_every: int = 100  # check one call in this many per layer when enabled
    fuse_glu: bool = True  # SiLU-mul of a W4A8 MLP in the gate_up GEMM's epilogue (one launch fewer per layer); False: its own launch
    # at decode sizes the o_proj / down_proj GEMMs leave their split-K partials for the residual-add norm
    # after them to sum, where that pays (w4a8.deferring_pays; 8B -58 us per step at batch 1, -77 at 8 on
    # the H200); False: each GEMM sums its own
    defer_split_sum: bool = True
    # on the CPU, float32 with cpu_int4 False is the exact path: decode 2.8x slower on the embedded model
    cpu_int4: bool = True  # 4-bit GGUF linears (Q4_0/Q4_1/Q4_K) on a CPU run torch's int4 kernel from their codes (bf16 activations, whose sums round with the batch's shape: a greedy answer alone and under load may differ); False: dequantized to the model dtype

    def __post_init__(self):
        _check_types(self)
        _check(1 <= self.decode_band <= 256, f"decode_band must be in [1, 256], got {self.decode_band!r}")
        _check(self.activations in ACTIVATIONS, f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        _check(self.numerics_check_every > 0,
               f"numerics_check_every must be positive, got {self.numerics_check_every!r}")


def _check_token_counts(counts: tuple[int, ...] | None, name: str, graphs: str) -> None:
    _check(counts is None or all(isinstance(t, int) and t >= 0 for t in counts),
           f"{name} must be token counts, integers >= 0 (0 alone: no {graphs} graphs), got {counts!r}")


DENSE_PREFILL_GRAPH_TOKENS = (128, 256, 512, 1024)
MOE_PREFILL_GRAPH_TOKENS = DENSE_PREFILL_GRAPH_TOKENS + (1536, 2048, 3072, 4096)
# the piecewise graphs' buckets: from a few decodes next to a short prompt up to the prefill buckets' sizes,
# with steps in between where padding costs: on the H200 one 256-token prompt next to 31 decodes (287 rows,
# padded to 512) took 12.6 ms for the 8B (MXFP4) against 6.0 ms for 127 rows (bench/RESULTS.md, 26th session)
PIECEWISE_DENSE_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
PIECEWISE_MOE_TOKENS = PIECEWISE_DENSE_TOKENS + (1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class RunnerConfig:
    """Model runner execution."""

    enforce_eager: bool = False  # True disables CUDA graphs
    # largest decode batch captured (capped by max_num_seqs; buckets 1, 2, 4, 8, then every 16): a larger
    # batch runs eagerly, host-bound on kernel launches (MXFP4 at 128 sequences: 0.76x bf16 before)
    cuda_graph_max_batch: int = 256
    # token-count buckets of single-sequence prefill steps replayed from CUDA graphs (padded to the
    # bucket; steps above the largest, or with several sequences, run eagerly). Eager, a short prefill
    # is host-bound on ~10 launches per layer: on the H200 the 8B's 512-token prefill went from 18k to
    # 36k tok/s (MXFP4) and 17k to 44k (bf16) with graphs (bench/RESULTS.md, sixth session). None: the
    # model's default, DENSE_PREFILL_GRAPH_TOKENS (from 2k tokens a dense model keeps the GPU busy either
    # way), or MOE_PREFILL_GRAPH_TOKENS with sparse MoE layers, whose ~20 more launches per layer (router,
    # routing, combine) keep the eager prefill host-bound up to ~4k tokens (Qwen3-30B-A3B MXFP4: 2048
    # tokens 82-120 ms eager, 44 ms replayed; bench/RESULTS.md, twenty-fifth session)
    prefill_graph_tokens: tuple[int, ...] | None = None  # prefill graph buckets (tokens); default: 128 to 1024 (to 4096 for sparse MoE models); 0: none
    # token-count buckets of the piecewise graphs that serve every other step up to the largest: several
    # sequences prefilling, prefill chunks mixed with decodes (engine.piecewise_graphs: the forward captured
    # between its prefill-attention launches, which run eagerly). Eager, such steps are host-bound: one
    # 256-token prompt next to 31 decodes took 83 ms for Qwen3-30B-A3B (MXFP4) on the H200, 26 ms replayed
    # (bench/RESULTS.md, twenty-sixth session). None: PIECEWISE_DENSE_TOKENS, or PIECEWISE_MOE_TOKENS for a
    # model with sparse MoE layers; 0: none (such steps run eagerly)
    piecewise_graph_tokens: tuple[int, ...] | None = None  # piecewise graph buckets (tokens) of mixed / multi-sequence steps; default: 16 to 1024 (to 4096 for sparse MoE models); 0: none
    # queue each decode step before reading the previous one's tokens, so the host's bookkeeping runs
    # while the device computes; default: on when decode steps replay CUDA graphs
    overlap_decode: bool | None = None

    def __post_init__(self):
        # the token counts first: their own message says what they are
        _check_token_counts(self.prefill_graph_tokens, "prefill_graph_tokens", "prefill")
        _check_token_counts(self.piecewise_graph_tokens, "piecewise_graph_tokens", "piecewise")
        _check_types(self)
        _check(self.cuda_graph_max_batch > 0,
               f"cuda_graph_max_batch must be positive, got {self.cuda_graph_max_batch!r}")

    def prefill_graph_buckets(self, sparse_moe: bool) -> tuple[int, ...]:
        """The prefill graph buckets for a model (with or without sparse MoE layers)."""
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens
        return MOE_PREFILL_GRAPH_TOKENS if sparse_moe else DENSE_PREFILL_GRAPH_TOKENS

    def piecewise_graph_buckets(self, sparse_moe: bool) -> tuple[int, ...]:
        """The piecewise graph buckets for a model (with or without sparse MoE layers)."""
        if self.piecewise_graph_tokens is not None:
            return self.piecewise_graph_tokens
        return PIECEWISE_MOE_TOKENS if sparse_moe else PIECEWISE_DENSE_TOKENS


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding of a lone sequence: the tokens that followed the latest
    earlier occurrence of its last few tokens are proposed and checked in one forward (exact: a draft is
    kept only where the model samples that very token). Pays on repetitive output (code edits, quoting,
    extraction); lookups that miss back off, so other text keeps the overlapped decode."""

    ngram_draft_tokens: int = 0  # tokens proposed per step (0: off); rows with logprobs, a seed, penalties, logit bias or structured output are not speculated
    ngram_max: int = 4  # longest suffix n-gram looked up in the sequence's own tokens
    ngram_min: int = 2  # shortest suffix n-gram that may match

    def __post_init__(self):
        _check_types(self)
        _check(0 <= self.ngram_draft_tokens <= 32,
               f"ngram_draft_tokens must be in [0, 32], got {self.ngram_draft_tokens!r}")
        _check(1 <= self.ngram_min <= self.ngram_max,
               f"ngram_min must be in [1, ngram_max], got ngram_min {self.ngram_min!r} with ngram_max "
               f"{self.ngram_max!r}")


@dataclass(frozen=True)
class LoraConfig:
    """PEFT LoRA adapters served on top of the base model, several in one batch (vLLM's multi-LoRA)."""

    enable_lora: bool = False  # serve LoRA adapters (a request's lora_request, the server's adapter model names)
    max_loras: int = 1  # adapters resident in one step's batch at most (requests for others wait)
    max_lora_rank: int = 16  # highest adapter rank r served (larger adapters are refused)
    max_cpu_loras: int | None = None  # adapters kept loaded in memory (least recently used dropped, read again when asked for); default: max_loras
    lora_modules: tuple[str, ...] = ()  # adapters loaded at start, as name=path or vLLM's JSON {"name": ..., "path": ...}; their ids are 1, 2, ... in order; default none

    def __post_init__(self):
        _check_types(self)
        _check(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras!r}")
        _check(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank!r}")
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        modules = self.parsed_modules()  # each one checked here
        _check(not modules or self.enable_lora,
               f"lora_modules need enable_lora, got {len(modules)} module(s) with enable_lora off")
        names = [name for name, _ in modules]
        _check(len(set(names)) == len(names), f"lora_modules names must differ, got {names!r}")

    def parsed_modules(self) -> tuple[tuple[str, str], ...]:
        """lora_modules as (name, path) pairs, in order (adapter ids 1, 2, ...)."""
        return tuple(_lora_module(spec) for spec in self.lora_modules)


def _lora_module(spec: str) -> tuple[str, str]:
    """One --lora-modules value: name=path, or vLLM's JSON form {"name": ..., "path": ...[, "base_model_name": ...]}."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise ConfigError(f"lora_modules: {spec!r} is not valid JSON") from None
        _check(isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("path"), str)
               and value["name"] and value["path"],
               f"lora_modules: a JSON module needs string \"name\" and \"path\", got {spec!r}")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    _check(bool(sep and name.strip() and path.strip()), f"lora_modules: expected name=path, got {spec!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        _check_types(self)

    @classmethod
    def from_flat(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (`max_num_seqs=8, quantization="none"`), routing each
        to the sub-config that owns it. Unknown names are an error, not silently dropped. None for a field that
        takes no None is its default, as vLLM's LLM(enable_prefix_caching=None) means."""
        parts = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory  # type: ignore[misc]
            names = {g.name: "None" in g.type.split(" | ") for g in dataclasses.fields(sub)}
            parts[f.name] = {k: v for k in list(kwargs) if k in names
                             for v in [kwargs.pop(k)] if v is not None or names[k]}
        if kwargs:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**{name: dataclasses.fields(cls)[i].default_factory(**vals)  # type: ignore[misc]
                      for i, (name, vals) in enumerate(parts.items())})



def _json_list_form(values: tuple[str, ...], name: str) -> tuple[str, ...]:
    """vLLM's form of a list flag, one JSON list (`--allowed-origins '["*"]'`), as the values it lists; taken as
    one literal value, it would match nothing."""
    if len(values) != 1 or not values[0].lstrip().startswith("["):
        return values
    try:
        listed = json.loads(values[0])
    except ValueError:
        raise ConfigError(f"{name}: {values[0]!r} is neither a value nor a JSON list of strings") from None
    _check(isinstance(listed, list) and all(isinstance(v, str) for v in listed),
           f"{name}: {values[0]!r} is no JSON list of strings")
    return tuple(listed)


TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "harmony", "none")
REASONING_PARSERS = ("auto", "think", "mistral", "harmony", "none")
# vLLM's names of the same parsers, so that a `vllm serve` command line's flags serve as they are
VLLM_TOOL_CALL_PARSERS = {"openai": "harmony", "glm47": "glm45"}
VLLM_REASONING_PARSERS = {"qwen3": "think", "deepseek_r1": "think", "glm45": "think", "openai_gptoss": "harmony",
                          "gpt_oss": "harmony"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
GENERATION_CONFIGS = ("auto", "none", "vllm")  # vllm: vLLM's name for none
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format values


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server (`radiance serve`)."""

    host: str = "127.0.0.1"  # interface to listen on; 0.0.0.0 for every interface
    port: int = 8000  # TCP port of the HTTP API; 0: a free one (the startup lines name it)
    served_model_name: tuple[str, ...] = ()  # first = the name, the rest aliases (each once); default from the model
    api_key: str | None = None  # when set, every route but /health, /metrics, /version and /ping needs `Authorization: Bearer KEY` (printable ASCII)
    chat_template: str | None = None  # a jinja file (or literal template) overriding the model's; default: the model's own
    # how a message's content reaches the template (vLLM's --chat-template-content-format): string (text parts joined
    # by newlines), openai (a list of {"type": "text", "text": ...} parts); auto: openai for a template that loops over a
    # message's content, else string
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False  # render a request's own `chat_template` (vLLM's field); off: such a request is a 400, since a template is code the server runs
    # a request's tools stay out of its prompt when its tool_choice is "none" (the model's default template, not its
    # tool_use one: the rendering before vLLM's flag of this name); off: rendered, as vLLM and OpenAI do (the model
    # knows its tools and calls none: no call is parsed out of its answer)
    exclude_tools_when_tool_choice_none: bool = False
    tool_call_parser: str = "auto"  # hermes, qwen3_coder, glm45, llama3_json, mistral, harmony (vLLM's openai), none; auto: the template's markup
    reasoning_parser: str = "auto"  # think (vLLM's qwen3, deepseek_r1), mistral, harmony (openai_gptoss), none; auto: from the template (<|channel|>: harmony, [THINK]: mistral, <think>: think)
    # auto: the sampling defaults of the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty) fill what a request leaves out and its max_new_tokens caps the output, as vLLM does;
    # none (or vllm, vLLM's name for it): OpenAI's defaults (temperature 1 ...)
    generation_config: str = "auto"
    max_logprobs: int = 20  # upper bound of logprobs / top_logprobs a request may ask for, in [0, 20] (OpenAI's limit: it only lowers it)
    max_n: int = 16  # upper bound of `n` (each choice is one engine request)
    responses_store: int = 1000  # /v1/responses kept in memory for previous_response_id and GET; 0 = none
    # the most bytes (as JSON) the stored /v1/responses take, oldest dropped first, one larger not kept; 0 = none.
    # Each keeps its whole input history: under the count alone a previous_response_id chain grows without end
    responses_store_bytes: int = 256 << 20
    # the start of every /metrics name: "vllm:" exports vLLM's names (vllm:num_requests_waiting, ...), which its
    # Grafana dashboard and autoscaling rules read
    metrics_prefix: str = "radiance_"
    uvicorn_log_level: str = "warning"  # log level of uvicorn's own access and error logs: critical, error, warning, info, debug, trace
    allowed_origins: tuple[str, ...] = ()  # origins whose web pages may call the API from a browser (CORS), e.g. https://chat.example.com, or * for any; default: pages of localhost / 127.0.0.1 / [::1] on any port
    ssl_keyfile: str | None = None  # serve HTTPS: the private key (PEM), with ssl_certfile
    ssl_certfile: str | None = None  # serve HTTPS: the certificate chain (PEM) of ssl_keyfile
    # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), which
    # load any adapter path the server can read; default off: the routes answer 404 as unknown routes do
    allow_runtime_lora_updating: bool = False

    def __post_init__(self):
        _check_types(self)
        # an empty host (an unset shell variable) would listen on every interface
        _check(self.host.strip() != "",
               f"host must be non-empty (0.0.0.0 listens on every interface), got {self.host!r}")
        _check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port!r}")
        _check(self.uvicorn_log_level.lower() in UVICORN_LOG_LEVELS,
               f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, got {self.uvicorn_log_level!r}")
        # frozen: the vLLM name becomes ours as the dataclass is made
        object.__setattr__(self, "tool_call_parser", VLLM_TOOL_CALL_PARSERS.get(self.tool_call_parser,
                                                                                self.tool_call_parser))
        object.__setattr__(self, "reasoning_parser", VLLM_REASONING_PARSERS.get(self.reasoning_parser,
                                                                                self.reasoning_parser))
        _check(self.tool_call_parser in TOOL_CALL_PARSERS, f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        _check(self.reasoning_parser in REASONING_PARSERS, f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        _check(0 <= self.max_logprobs <= 20, f"max_logprobs must be in [0, 20], got {self.max_logprobs!r}")
        _check(self.max_n >= 1, f"max_n must be positive, got {self.max_n!r}")
        _check(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", self.metrics_prefix) is not None,
               f"metrics_prefix must start a Prometheus metric name (letters, digits, _ and :), got "
               f"{self.metrics_prefix!r}")
        _check(self.chat_template_content_format in CONTENT_FORMATS, f"chat_template_content_format must be one of "
               f"{CONTENT_FORMATS}, got {self.chat_template_content_format!r}")
        _check(self.generation_config in GENERATION_CONFIGS,
               f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        _check(self.responses_store >= 0, f"responses_store must be >= 0, got {self.responses_store!r}")
        _check(self.responses_store_bytes >= 0,
               f"responses_store_bytes must be >= 0, got {self.responses_store_bytes!r}")
        _check(all(name for name in self.served_model_name),
               f"served_model_name entries must be non-empty, got {self.served_model_name!r}")
        _check_distinct(self.served_model_name, "served_model_name")
        _check((self.ssl_keyfile is None) == (self.ssl_certfile is None),
               f"HTTPS needs both ssl_keyfile and ssl_certfile (or neither, for HTTP), got {_lone_ssl_file(self)}")
        object.__setattr__(self, "allowed_origins", _json_list_form(self.allowed_origins, "allowed_origins"))
        _check(all(origin for origin in self.allowed_origins),
               f"allowed_origins entries must be non-empty, got {self.allowed_origins!r}")
        _check(self.api_key is None or self.api_key != "", "api_key must be non-empty when given, got ''")
        _check(self.api_key is None or _HEADER_TOKEN.fullmatch(self.api_key) is not None,
               "api_key must be printable ASCII without leading or trailing spaces: the Authorization header "
               "carries it, and clients strip the spaces (a key of spaces or a newline could never match), got "
               f"{_api_key_fault(self.api_key or '')}")


# printable ASCII, inner spaces allowed: what an HTTP header value carries unchanged
_HEADER_TOKEN = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def _api_key_fault(key: str) -> str:
    """What is wrong with an API key, without the key: a message may reach a log others read."""
    odd = next((i for i, ch in enumerate(key) if not "\x20" <= ch <= "\x7e"), None)
    if odd is not None:
        return f"a key of {len(key)} characters whose character {odd + 1} is {_char_name(key[odd])}"
    return f"a key of {len(key)} characters with a leading or trailing space"


def _char_name(ch: str) -> str:
    return f"U+{ord(ch):04X}" + (" (a control character)" if ord(ch) < 0x20 or ord(ch) == 0x7f else "")


def _lone_ssl_file(config: ServerConfig) -> str:
    return "ssl_keyfile without ssl_certfile" if config.ssl_certfile is None else "ssl_certfile without ssl_keyfile"


def _check_distinct(values: tuple[str, ...], name: str) -> None:
    """A name given twice is a typo (two names meant) or a copy: either way /v1/models would list it twice."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    _check(not repeated, f"{name} lists {', '.join(map(repr, repeated))} more than once")


CONVERT_FORMATS = ("mxfp4", "nvfp4", "fp8")
DENSE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class ConvertConfig:
    """Checkpoint conversion (`radiance convert`): the format written and what stays 16-bit."""

    format: str = "mxfp4"  # linears are written in this format (compressed-tensors layout): mxfp4, nvfp4 or fp8 (an MXFP4 source to nvfp4 / fp8 keeps its values exactly: power-of-two scales)
    rule: str = "mse"  # block-exponent rule when converting to MXFP4: mse (least squared error), noclip or ocp
    ignore: tuple[str, ...] = ()  # regexes (re.search) of linears to keep 16-bit, e.g. "layers\\.0\\.": radiance's names (qkv_proj) or the checkpoint's (q_proj, k_proj, v_proj: a fused linear's parts all or none)
    quantize_lm_head: bool = False  # lm_head stays 16-bit unless set (a tied head is then untied)
    dense_dtype: str = "bfloat16"  # dtype of the 16-bit tensors written (embeddings, norms, kept linears): bfloat16 or float16
    max_shard_bytes: int = 2 << 30  # safetensors shard size
    chunk_rows: int | None = None  # rows per requant chunk (bounds the fp32 transient); default: automatic

    def __post_init__(self):
        _check_types(self)
        _check(self.format in CONVERT_FORMATS, f"format must be one of {CONVERT_FORMATS}, got {self.format!r}")
        _check(self.rule in RULES, f"rule must be one of {RULES}, got {self.rule!r}")
        _check(self.dense_dtype in DENSE_DTYPES, f"dense_dtype must be one of {DENSE_DTYPES}, got {self.dense_dtype!r}")
        _check(self.max_shard_bytes > 0, f"max_shard_bytes must be positive, got {self.max_shard_bytes!r}")
        _check(self.chunk_rows is None or self.chunk_rows > 0, f"chunk_rows must be positive, got {self.chunk_rows!r}")
        _check_regexes(self.ignore, "ignore")
