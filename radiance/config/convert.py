"""Checkpoint conversion's knobs (`radiance convert`): ConvertConfig."""

from __future__ import annotations

from dataclasses import dataclass

from radiance.config.engine import RULES
from radiance.config.validation import check, check_regexes
from radiance.config_types import check_types as _check_types


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
        check(self.format in CONVERT_FORMATS, f"format must be one of {CONVERT_FORMATS}, got {self.format!r}")
        check(self.rule in RULES, f"rule must be one of {RULES}, got {self.rule!r}")
        check(self.dense_dtype in DENSE_DTYPES, f"dense_dtype must be one of {DENSE_DTYPES}, got {self.dense_dtype!r}")
        check(self.max_shard_bytes > 0, f"max_shard_bytes must be positive, got {self.max_shard_bytes!r}")
        check(self.chunk_rows is None or self.chunk_rows > 0, f"chunk_rows must be positive, got {self.chunk_rows!r}")
        check_regexes(self.ignore, "ignore")
