"""Reading one field of a config.json: absent and null alike, numbers checked, as transformers' configs read them."""

from __future__ import annotations

from radiance.errors import ConfigError


def given(config: dict, key: str, default):
    """config[key], or `default` where the key is absent or null (a null is as missing as an absent key)."""
    value = config.get(key)
    return default if value is None else value


def positive(config: dict, key: str, default, integer: bool = False):
    """A positive number from config.json (`default` when absent or null); anything else a ConfigError, not a
    TypeError deep in a layer."""
    value = given(config, key, default)
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"config.json field {key!r} must be {what}, got {value!r}")
    return value
