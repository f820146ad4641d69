"""The sampling defaults a model's creators ship in its generation_config.json (Llama 3.1 Instruct: temperature
0.6, top_p 0.9; Qwen3: 0.6, 0.95, top_k 20): the server fills a request's omitted sampling fields with them, as
vLLM does by default (`--generation-config auto`), so that a client that sends none gets the model's recommended
sampling rather than OpenAI's temperature 1.0. Only the keys the file gives count (not transformers' own
defaults, such as its top_k 50), and `do_sample` is not read (vLLM neither): a file that names a temperature
recommends it. As vLLM reads the file (transformers' GenerationConfig.to_diff_dict), a value equal to
transformers' own default is no recommendation: a file's top_k 50 leaves top_k off. `max_new_tokens` caps every
request's output (vLLM: "a server-wide limit on the number of output tokens")."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, fields

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """A request's sampling field where it gives none; None: OpenAI's default (temperature 1, top_p 1, no top_k,
    no min_p, repetition_penalty 1)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens: the most output tokens a request gets

    def given(self) -> dict[str, float | int]:
        """The fields set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        return ", ".join(f"{name} {value:g}" for name, value in self.given().items()) or "none"


# each key's check: the ranges a request may ask for (server/protocol.py)
_VALID = {
    "temperature": lambda v: 0.0 <= v <= 2.0,
    "top_p": lambda v: 0.0 < v <= 1.0,
    "top_k": lambda v: float(v).is_integer() and v >= -1,
    "min_p": lambda v: 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: v > 0.0,
    "max_new_tokens": lambda v: float(v).is_integer() and v >= 1,
}
# transformers' GenerationConfig defaults: a file that repeats one recommends nothing (vLLM drops them)
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def read_sampling_defaults(path: str | None) -> SamplingDefaults:
    """The sampling defaults of the checkpoint at `path` (a directory holding generation_config.json, or that file
    itself); none for a path without one (a GGUF file, a synthetic model). A value out of a request's range or not
    a number is left out with a warning naming the file and key: a bad recommendation must not stop the server."""
    if path is None:
        return SamplingDefaults()
    source = path if os.path.basename(path) == GENERATION_CONFIG else os.path.join(path, GENERATION_CONFIG)
    if not os.path.isfile(source):
        return SamplingDefaults()
    try:
        with open(source, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        logger.warning("%s: not read (%s); requests keep OpenAI's sampling defaults", source, exc)
        return SamplingDefaults()
    if not isinstance(config, dict):
        logger.warning("%s: not a JSON object; requests keep OpenAI's sampling defaults", source)
        return SamplingDefaults()
    values = {}
    for key, valid in _VALID.items():
        value = config.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not valid(value):
            logger.warning("%s: %s %r is no value a request may ask for; left out", source, key, value)
            continue
        if value == _TRANSFORMERS_DEFAULTS.get(key):
            continue
        if key == "max_new_tokens":
            values["max_tokens"] = int(value)
        else:
            values[key] = int(value) if key == "top_k" else float(value)
    return SamplingDefaults(**values)
