"""Qwen3-coder's calls: `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`, the
values typed by the tool's JSON schema."""

from __future__ import annotations

import json
import math
import re

from radiance.server.tool_parsers.base import ParsedToolCall, ToolParser, _loads

class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
    _VALUE_END = re.compile(r"</parameter>|<parameter=|</function>")

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        fn = self._FUNCTION.search(body)
        if not fn or not self.offers(name := fn.group(1).strip()):
            return None
        schema = ((self.tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args: dict = {}
        pos = fn.end()
        while (param := self._PARAMETER.search(body, pos)) is not None:
            end = self._value_end(body, param.end())
            if end is None and cut:
                break  # value cut off by max_tokens: keep only whole parameters
            stop = end.start() if end else len(body)
            key = param.group(1).strip()
            args[key] = _convert(_strip_newline(body[param.end():stop]), schema.get(key))
            pos = end.end() if end and end.group(0) == "</parameter>" else stop
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except RecursionError:  # a value read nested deeper than json writes it: no call
            return None
        # a cut after </function> (in the end tag) left the call whole
        return ParsedToolCall(name, arguments, not cut or self.stopped_call_whole(body))

    def _value_end(self, body: str, start: int) -> re.Match | None:
        """Where the value starting at `start` ends: the first </parameter> that the next parameter, the
        </function> or the end of the body follows (one inside the value, code that writes the markup, is part of
        it); else the first end found, as a model that forgot a </parameter> writes."""
        first = None
        for match in self._VALUE_END.finditer(body, start):
            first = first or match
            if match.group(0) != "</parameter>":
                return first
            rest = body[match.end():].lstrip()
            if not rest or rest.startswith(("<parameter=", "</function>")):
                return match
        return first

    def end_tag_closes(self, body: str) -> bool:
        """A </tool_call> inside an open parameter value (code that writes the markup) does not end the call:
        taking it as the end made a call of a cut value, marked complete."""
        opened = [m.end() for m in self._PARAMETER.finditer(body)]
        return not opened or self._VALUE_END.search(body, opened[-1]) is not None

    def stopped_call_whole(self, body: str) -> bool:
        """A call ends with </function> (the grammar's and the template's markup): without it, the model stopped
        mid-call, perhaps before further parameters, so the markup is text, not a call."""
        fn = self._FUNCTION.search(body)
        return fn is not None and "</function>" in body[fn.end():]


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _convert(value: str, schema: dict | None):
    """Parameter values are text; the tool's JSON schema says what they really are."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return value
    if value.strip().lower() in ("null", "none"):
        return None
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            if not math.isfinite(number):
                return value  # "inf" / "nan": no JSON number
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        return _loads(value)
    except (ValueError, KeyError, RecursionError):  # RecursionError: nested too deep to read, kept as text
        return value
