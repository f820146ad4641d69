"""The argparse glue of radiance.config: `add_dataclass_args` / `dataclass_kwargs` turn any config dataclass into
`--field-name` flags (help from the field's comment, defaults left in the class) and back; `add_engine_args` /
`engine_config_from_args` do it for every part of EngineConfig."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import re
import types
import typing

from radiance.config import DTYPE_ALIASES, DTYPES, EngineConfig
from radiance.errors import RadianceError


def _base_type(tp):
    """(python type, is_optional, is_tuple) of a dataclass field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base, _, is_tuple = _base_type(args[0])
        return base, True, is_tuple
    if origin is tuple:
        return typing.get_args(tp)[0], False, True
    return tp, False, False




def parse_dtype(text: str) -> str | None:
    """--dtype: one of DTYPES or vLLM's name of one."""
    if text in DTYPES:
        return text
    if text in DTYPE_ALIASES:
        return DTYPE_ALIASES[text]
    names = ", ".join((*DTYPES, *DTYPE_ALIASES))
    raise argparse.ArgumentTypeError(f"expected one of {names}, got {text!r}")


# flags whose text is read by more than the field's type: (type, what its help adds)
_FIELD_TYPES = {"dtype": (parse_dtype, f"; one of {', '.join(DTYPES)}, or vLLM's half, float, auto")}


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


@functools.lru_cache(maxsize=None)
def field_help(cls) -> dict[str, str]:
    """Each field's explanation in the class source, the one place a field is explained: its trailing `# comment`,
    else the block of `#` lines right above it (for a field whose reason takes several lines)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    helps, block = {}, []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        field = re.match(r"^\s+(\w+):[^#]*?(?:#\s*(.+))?$", line)
        if field and (field.group(2) or block):
            helps[field.group(1)] = (field.group(2) or " ".join(block)).strip()
        block = []
    return helps


def _help_with_default(text: str, default) -> str:
    """A field's help with its default; an unset default (None, empty) is the comment's to explain, since
    "(default: None)" tells a user nothing."""
    if default is None or default == ():
        return text if "default" in text else f"{text} (default: none)".lstrip()
    return f"{text} (default: {default})".lstrip()


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), group: str | None = None) -> None:
    """Add a `--field-name` flag for every field of dataclass `cls` (defaults stay in the class)."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    target = parser.add_argument_group(group or cls.__name__) if group is not False else parser
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]):
            continue
        base, optional, is_tuple = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        # argparse %-formats help strings: a comment's "20%" would break --help
        parse, more_help = _FIELD_TYPES.get(f.name, (None, ""))
        help_text = _help_with_default(helps.get(f.name, "") + more_help, default).replace("%", "%%")
        if parse is not None:
            target.add_argument(flag, type=parse, default=argparse.SUPPRESS, help=help_text)
        elif base is bool:
            target.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=argparse.SUPPRESS,
                                metavar="BOOL", help=help_text)
        elif is_tuple:
            target.add_argument(flag, type=base, nargs="+", default=argparse.SUPPRESS, help=help_text)
        else:
            target.add_argument(flag, type=base, default=argparse.SUPPRESS, help=help_text)


def dataclass_kwargs(args: argparse.Namespace, cls) -> dict:
    """The fields of `cls` that were given on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def flag_of(name: str) -> str:
    """The flag that sets a field: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


_QUOTED = re.compile(r"""('[^']*'|"[^"]*")""")  # a value the message quotes, which may look like a field name


def in_flag_words(message: str, flags: dict[str, str], given: dict[str, object] | None = None) -> str:
    """A config's message in the words of the command line: each field it names (outside quoted values) as its
    flag, and a number the user gave, where the message does not say it, after it ("--port must be in [0, 65535],
    got 70000")."""
    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    field = re.compile(rf"(?<![\w-])({names})(?![\w-])")
    parts = _QUOTED.split(message)
    for i in range(0, len(parts), 2):  # the odd parts are the quoted ones
        parts[i] = field.sub(lambda m: flags[m.group(1)], parts[i])
    worded = "".join(parts)
    first = field.match(message)
    value = (given or {}).get(first.group(1)) if first else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and " got " not in f" {message}":
        worded += f", got {value}"
    return worded


@contextlib.contextmanager
def errors_in_flag_words(given: dict[str, object], fields=(), flags: dict[str, str] | None = None):
    """An error raised while a config is built from the command line names the flags the user typed, not the
    dataclass fields behind them ("max_model_len must be positive" read as a typo of the user's). `given`: the
    fields set on the command line; `fields`: the other fields with a flag; `flags`: fields whose flag is not
    flag_of(field) (generate's --sampling-seed)."""
    try:
        yield
    except RadianceError as exc:
        if exc.args and isinstance(exc.args[0], str):
            names = {name: flag_of(name) for name in (*fields, *given)} | (flags or {})
            exc.args = (in_flag_words(exc.args[0], names, given), *exc.args[1:])
        raise


def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def config_from_args(args: argparse.Namespace, cls):
    """The dataclass `cls` from the flags given (its defaults for the rest); its errors name the flags."""
    given = dataclass_kwargs(args, cls)
    with errors_in_flag_words(given, _field_names(cls)):
        return cls(**given)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(EngineConfig):
        add_dataclass_args(parser, f.default_factory, skip=skip, group=f"{f.name} options")  # type: ignore[misc]


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    flat = {}
    for f in dataclasses.fields(EngineConfig):
        flat.update(dataclass_kwargs(args, f.default_factory))  # type: ignore[misc]
    flat.update({k: v for k, v in overrides.items() if v is not None})
    fields = [name for f in dataclasses.fields(EngineConfig) for name in _field_names(f.default_factory)]
    with errors_in_flag_words(flat, fields):
        return EngineConfig.from_flat(**flat)
