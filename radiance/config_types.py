"""The field types of radiance.config's dataclasses, checked from their annotations (`check_types`, first in each
`__post_init__`): a value of the wrong type from Python is a one-line ConfigError naming the field, and numpy's
numbers and bools or a path are stored as the plain Python values."""

from __future__ import annotations

import dataclasses
import numbers
import os

from radiance.errors import ConfigError


def _as_int(value):
    return int(value) if isinstance(value, numbers.Integral) and not _is_bool(value) else _WRONG


def _as_float(value):
    return float(value) if isinstance(value, numbers.Real) and not _is_bool(value) else _WRONG


def _as_bool(value):  # numpy's bools and 0 / 1 too, as SamplingParams takes them
    ok = _is_bool(value) or isinstance(value, numbers.Integral) and value in (0, 1)
    return bool(value) if ok else _WRONG


def _as_str(value):  # a pathlib.Path for a model or a file
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    return value if isinstance(value, str) else _WRONG


def _is_bool(value) -> bool:
    """True and False (Python's or numpy's) are not counts or fractions to a config."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b"


_WRONG = object()
_PLAIN_TYPES = {"int": (_as_int, "an integer"), "float": (_as_float, "a number"), "bool": (_as_bool, "true or false"),
                "str": (_as_str, "a string")}


def check_types(config) -> None:
    """Each field holds a value of its annotated type (from Python a string for an int was a TypeError deep in a
    comparison, or passed unseen), stored as the plain Python value (numpy's numbers and bools, a path as its
    string, a list for a tuple field as the tuple). Annotations are strings here (`from __future__ import
    annotations`): int, float, bool, str, tuple[T, ...], a config class, each `| None`."""
    for f in dataclasses.fields(config):
        value, kinds = getattr(config, f.name), f.type.split(" | ")
        if value is None and "None" in kinds:
            continue
        kind = next(k for k in kinds if k != "None")
        if kind.startswith("tuple["):
            convert, words = _PLAIN_TYPES[kind[len("tuple["):-len(", ...]")]]
            items = [convert(v) for v in value] if isinstance(value, (tuple, list)) else [_WRONG]
            if any(item is _WRONG for item in items):
                raise ConfigError(f"{f.name} must be a tuple of values each {words}, got {value!r}")
            object.__setattr__(config, f.name, tuple(items))
        elif kind in _PLAIN_TYPES:
            convert, words = _PLAIN_TYPES[kind]
            converted = convert(value)
            if converted is _WRONG:
                raise ConfigError(f"{f.name} must be {words}{' or None' if 'None' in kinds else ''}, got {value!r}")
            object.__setattr__(config, f.name, converted)
        else:  # a nested config: EngineConfig's parts
            if type(value).__name__ != kind:
                raise ConfigError(f"{f.name} must be a {kind}, got {value!r}")
