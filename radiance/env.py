"""The one module that reads environment variables: the log level's default and Triton's own interpreter switch
(huggingface_hub reads HF_HOME / HF_TOKEN itself). Everything else is configured through radiance.config."""

import os


def log_level(default: str = "INFO") -> str:
    return os.environ.get("RADIANCE_LOG_LEVEL", default).upper()


def triton_interpret() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
