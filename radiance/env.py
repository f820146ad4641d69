"""The one module that reads environment variables: the log level's default, Triton's own interpreter switch and,
for its messages, which variable turned huggingface_hub's offline mode on (huggingface_hub reads HF_HOME / HF_TOKEN /
HF_HUB_OFFLINE itself). Everything else is configured through radiance.config."""

import os


def log_level(default: str = "INFO") -> str:
    return os.environ.get("RADIANCE_LOG_LEVEL", default).upper()


def triton_interpret() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline_settings() -> list[str]:
    """["HF_HUB_OFFLINE=1"], ["TRANSFORMERS_OFFLINE=1"] or both: the variables set that turn huggingface_hub's offline
    mode on (it reads the first that is set, so both must go for it to go online), to name them in a message."""
    return [f"{name}={os.environ[name]}" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
            if os.environ.get(name, "").upper() in _TRUE]  # huggingface_hub's reading: "0" is off
