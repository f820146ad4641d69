"""Terminal tables and JSON for benchmark results: one place that decides how numbers print."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radiance.errors import ConfigError


def format_number(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: Sequence[int] | None = None) -> str:
    """Right-aligned plain-text table; `digits` gives the decimals of each float column."""
    digits = list(digits) if digits is not None else [1] * len(headers)
    cells = [[format_number(v, digits[i]) for i, v in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null so any JSON reader accepts the output."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(obj: Any) -> str:
    return json.dumps(_json_safe(obj), indent=2)


def check_output_path(path: str, flag: str) -> None:
    """A file a command writes at its end: checked before the run, so a typo costs an error line, not the run."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{flag} {path} is a directory, expected a file name")
    if not file.parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {file.parent} does not exist")
    if not os.access(file.parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: directory {file.parent} is not writable")
