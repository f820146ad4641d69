"""Every knob of radiance as frozen dataclasses.

Each area owns one dataclass; `EngineConfig` bundles the ones the engine needs (engine.py), `ServerConfig` is the
HTTP server's (server.py), `ConvertConfig` checkpoint conversion's (convert.py). Validation lives in `__post_init__`
so a bad value fails where it is built, with the field's name in the message (validation.py holds the shared
checks). radiance.config_cli turns any of these into argparse flags and back, so every field is reachable from the
command line without a hand-written flag per field.
"""

from radiance.config.convert import CONVERT_FORMATS, DENSE_DTYPES, ConvertConfig
from radiance.config.engine import (ACTIVATIONS, DENSE_PREFILL_GRAPH_TOKENS, DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPES,
                                    LM_HEAD_FORMATS, MODEL_RULES, MOE_PREFILL_GRAPH_TOKENS, PIECEWISE_DENSE_TOKENS,
                                    PIECEWISE_MOE_TOKENS, QUANTIZATIONS, RULES, CacheConfig, EngineConfig,
                                    KernelConfig, LoraConfig, ModelConfig, RunnerConfig, SchedulerConfig,
                                    SpeculativeConfig)
from radiance.config.server import (CONTENT_FORMATS, GENERATION_CONFIGS, REASONING_PARSERS, TOOL_CALL_PARSERS,
                                    UVICORN_LOG_LEVELS, VLLM_REASONING_PARSERS, VLLM_TOOL_CALL_PARSERS, ServerConfig)
from radiance.config.validation import SEED_RANGE, check_seed
from radiance.errors import ConfigError

__all__ = [
    "ACTIVATIONS", "CONTENT_FORMATS", "CONVERT_FORMATS", "DENSE_DTYPES", "DENSE_PREFILL_GRAPH_TOKENS", "DTYPE_ALIASES",
    "DTYPES", "GENERATION_CONFIGS", "KV_CACHE_DTYPES", "LM_HEAD_FORMATS", "MODEL_RULES", "MOE_PREFILL_GRAPH_TOKENS",
    "PIECEWISE_DENSE_TOKENS", "PIECEWISE_MOE_TOKENS", "QUANTIZATIONS", "REASONING_PARSERS", "RULES", "SEED_RANGE",
    "TOOL_CALL_PARSERS", "UVICORN_LOG_LEVELS", "VLLM_REASONING_PARSERS", "VLLM_TOOL_CALL_PARSERS", "CacheConfig",
    "ConfigError", "ConvertConfig", "EngineConfig", "KernelConfig", "LoraConfig", "ModelConfig", "RunnerConfig",
    "SchedulerConfig", "ServerConfig", "SpeculativeConfig", "check_seed",
]
