"""Reading one field of a config.json: absent and null alike, numbers checked, as transformers' configs read them."""

from __future__ import annotations

import math

from radiance.errors import ConfigError


def is_positive_number(value) -> bool:
    """A number above 0 and finite: not a bool, and not NaN or Infinity, which Python's json reads (a NaN passed
    `value <= 0` and served empty answers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and (isinstance(value, int) or math.isfinite(value))


def given(config: dict, key: str, default):
    """config[key], or `default` where the key is absent or null (a null is as missing as an absent key)."""
    value = config.get(key)
    return default if value is None else value


def positive(config: dict, key: str, default, integer: bool = False):
    """A positive number from config.json (`default` when absent or null); anything else a ConfigError, not a
    TypeError deep in a layer."""
    value = given(config, key, default)
    if not is_positive_number(value) or (integer and not isinstance(value, int)):
        what = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"config.json field {key!r} must be {what}, got {value!r}")
    return value
