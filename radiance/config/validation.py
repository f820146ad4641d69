"""The checks every config dataclass's __post_init__ shares: each message names the field, what it takes and the
value given."""

from __future__ import annotations

import re

from radiance.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    """Every message names the field, what it takes and the value given (`got ...`): the CLI words it in flags
    (config_cli.in_flag_words), which adds no value of its own to a message that says one."""
    if not cond:
        raise ConfigError(msg)


SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.long's, as the server's request `seed` (and vLLM's) takes


def check_seed(seed: int, name: str) -> None:
    """A seed torch takes: beyond 64 bits torch.manual_seed failed after the checkpoint opened, as "Overflow when
    unpacking long long". Negatives stay valid: torch maps one to seed + 2**64, so -1 and 1 differ."""
    low, high = SEED_RANGE
    check(low <= seed <= high, f"{name} must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {seed}")


def check_regexes(patterns: tuple[str, ...], name: str) -> None:
    """Each pattern compiles: a typo is the user's to fix before a model loads, not a traceback halfway through."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{name}: {pattern!r} is not a regular expression: {exc}") from None
