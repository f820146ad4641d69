"""The one module that reads environment variables (standard ones only: HF_HOME, log level)."""

import os


def log_level(default: str = "INFO") -> str:
    return os.environ.get("RADIANCE_LOG_LEVEL", default).upper()


def triton_interpret() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
