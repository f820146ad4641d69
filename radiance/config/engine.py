"""The engine's knobs: what to load and how to quantize it, the KV cache, the scheduler, the kernels, the runner's
graphs, speculative decoding and LoRA, bundled as EngineConfig."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from radiance.config.validation import check, check_regexes, check_seed
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
        check(self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check(self.rule in MODEL_RULES, f"rule must be one of {MODEL_RULES}, got {self.rule!r}")
        check(self.rule != "none" or self.quantization == "nvfp4",
               f"rule 'none' only applies to quantization 'nvfp4', got quantization {self.quantization!r} (with "
               "quantization nvfp4, rule none serves NVFP4 weights, a checkpoint's or 16-bit ones quantized at load, "
               "dequantized as W4A16)")
        check(self.dtype is None or self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len must be positive, got {self.max_model_len!r}")
        check_seed(self.seed, "seed")
        check_regexes(self.ignore, "ignore")
        check(not self.quantize_lm_head or self.quantization in ("mxfp4", "nvfp4"),
               "quantize_lm_head needs quantization mxfp4 or nvfp4 (it quantizes a 16-bit head at load), got "
               f"quantization {self.quantization!r}")
        check(self.lm_head_format in LM_HEAD_FORMATS,
               f"lm_head_format must be one of {LM_HEAD_FORMATS}, got {self.lm_head_format!r}")
        check(self.lm_head_format == "mxfp4" or self.quantize_lm_head,
               f"lm_head_format {self.lm_head_format!r} applies to a quantized lm_head, got quantize_lm_head off: "
               "add quantize_lm_head")
        check(self.lm_head_format == "mxfp4" or self.rule != "none",
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
        check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two, got {self.block_size!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(self.cpu_kv_cache_bytes > 0, f"cpu_kv_cache_bytes must be positive, got {self.cpu_kv_cache_bytes!r}")
        check(self.prefix_states is None or self.prefix_states >= 0,
               f"prefix_states must be 0 or more, got {self.prefix_states!r}")
        check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
               f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64  # sequences decoded together at most
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits above it)
    enable_chunked_prefill: bool = True  # split long prompts across steps so decodes keep running

    def __post_init__(self):
        _check_types(self)
        check(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs!r}")
        check(self.max_num_batched_tokens > 0,
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
        check(1 <= self.decode_band <= 256, f"decode_band must be in [1, 256], got {self.decode_band!r}")
        check(self.activations in ACTIVATIONS, f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        check(self.numerics_check_every > 0,
               f"numerics_check_every must be positive, got {self.numerics_check_every!r}")


def _check_token_counts(counts: tuple[int, ...] | None, name: str, graphs: str) -> None:
    check(counts is None or all(isinstance(t, int) and t >= 0 for t in counts),
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
        check(self.cuda_graph_max_batch > 0,
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
        check(0 <= self.ngram_draft_tokens <= 32,
               f"ngram_draft_tokens must be in [0, 32], got {self.ngram_draft_tokens!r}")
        check(1 <= self.ngram_min <= self.ngram_max,
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
        check(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras!r}")
        check(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank!r}")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        modules = self.parsed_modules()  # each one checked here
        check(not modules or self.enable_lora,
               f"lora_modules need enable_lora, got {len(modules)} module(s) with enable_lora off")
        names = [name for name, _ in modules]
        check(len(set(names)) == len(names), f"lora_modules names must differ, got {names!r}")

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
        check(isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("path"), str)
               and value["name"] and value["path"],
               f"lora_modules: a JSON module needs string \"name\" and \"path\", got {spec!r}")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    check(bool(sep and name.strip() and path.strip()), f"lora_modules: expected name=path, got {spec!r}")
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
