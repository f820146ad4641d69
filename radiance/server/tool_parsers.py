"""Tool-call parsers: turn model text with tool-call markup into OpenAI tool calls.

Three markups in the text: Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Qwen3-coder
(`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`) and Llama 3.x (an answer
that is `{"name": ..., "parameters": {...}}`, Llama3JsonToolParser). gpt-oss's harmony format calls a function
with a message of its own, which the harmony reasoning parser hands over whole (HarmonyToolParser).

One incremental scanner serves both streaming and non-streaming requests (non-streaming feeds the
whole text at once), so both give the same result by construction. Text outside calls streams out
as content; a possible start tag at a chunk's end is held back until the next chunk decides; a call
is emitted whole when its end tag arrives. A call cut off by max_tokens is parsed at `finish()` from
what was generated, its markup never reaching the content. Whitespace that only separates content from
calls is dropped.

A call must be usable: it names one of the request's tools and its arguments are a JSON object. Markup that
is no such call (broken JSON, another name, a list for arguments, a tag the model opened and never closed
before it stopped) is the model's text, and goes out as content unchanged, as vLLM returns it. A call the
model stopped in (its end tag never came, and max_tokens did not cut it) is a call only when it is whole
(`stopped_call_whole`: its JSON parses; a Qwen3-coder call has its `</function>`), as a harmony message
the model stopped in is; otherwise it is text. (vLLM's qwen3_coder parser also takes a `<function=` left
open as a call, parameters and all; a call cut short is no call its client can trust.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from radiance.engine.tool_grammars import CALL_START as START_TAG
from radiance.server.reasoning_parser import FunctionMessage
from radiance.server.streaming_text import LeadingSpaceEater, partial_tag_start

END_TAG = "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text (may be incomplete JSON, or "", for a JSON call cut off by max_tokens)
    complete: bool = True  # False: cut off by max_tokens before its arguments were whole


@dataclass
class ParseDelta:
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __iadd__(self, other: "ParseDelta") -> "ParseDelta":
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


def _reject_non_finite(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _loads(text: str):
    """json.loads without NaN / Infinity, which Python reads but a client's JSON parser refuses."""
    return json.loads(text, parse_constant=_reject_non_finite)


class ToolParser:
    """Incremental scanner; subclasses only say how one call's body becomes a ParsedToolCall."""

    name = "base"

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self._buffer = ""
        self._in_call = False
        self._held_space = ""  # trailing whitespace of content, dropped if a call follows
        self._space_before_call = ""  # that whitespace, given back if the call turns out to be text
        self._after_call = LeadingSpaceEater()
        self.num_calls = 0

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        """One call's body -> the parsed call, None when it is no usable call; each format defines it. `cut`:
        max_tokens ended the output inside the call, so a partial call is read from what was generated."""
        raise TypeError(f"{type(self).__name__} must define parse_call")

    def offers(self, name) -> bool:
        """A call must name one of the request's tools (a parser made without tools takes any name)."""
        return isinstance(name, str) and (not self.tools or name in self.tools)

    def _content(self, out: ParseDelta, text: str) -> None:
        text = self._after_call(text)
        if not text:
            return
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        out.content += body

    def _call(self, out: ParseDelta, body: str, cut: bool) -> bool:
        """Parses one call into `out`; False when the body is no usable call."""
        call = self.parse_call(body, cut)
        if call is None:
            return False
        out.tool_calls.append(call)
        self.num_calls += 1
        return True

    def _not_a_call(self, out: ParseDelta, markup: str) -> None:
        """Markup that held no usable call is text: content as written, with the whitespace before it."""
        self._held_space = self._space_before_call
        self._content(out, markup)

    def feed(self, delta: str) -> ParseDelta:
        out = ParseDelta()
        self._buffer += delta
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(END_TAG)
                if end < 0:
                    break
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(END_TAG):]
                self._in_call = False
                if self._call(out, body, cut=False):
                    self._after_call.active = True
                else:
                    self._not_a_call(out, START_TAG + body + END_TAG)
                continue
            start = self._buffer.find(START_TAG)
            if start >= 0:
                self._content(out, self._buffer[:start])
                self._space_before_call, self._held_space = self._held_space, ""
                self._buffer = self._buffer[start + len(START_TAG):]
                self._in_call = True
                continue
            keep = partial_tag_start(self._buffer, START_TAG)
            self._content(out, self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            break
        return out

    def stopped_call_whole(self, body: str) -> bool:
        """Whether a call the model stopped in (no end tag, not cut by max_tokens) is whole as written; a
        format whose calls close their own body (Qwen3-coder's </function>) says so here."""
        return True

    def function_message(self, message: FunctionMessage, truncated: bool = False) -> ParseDelta:
        """A harmony message to a function (the reasoning parser's): a markup that writes calls in the text
        reads none there, so its body is content."""
        return ParseDelta(content=message.arguments)

    def finish(self, truncated: bool = False) -> ParseDelta:
        """End of generation. `truncated`: cut off by max_tokens (a dangling partial tag is markup)."""
        out = ParseDelta()
        if self._in_call:  # the output ended inside a call; a partial end tag is markup, not arguments
            body = self._buffer[:partial_tag_start(self._buffer, END_TAG)]
            if truncated:
                self._call(out, body.rstrip(), cut=True)  # nothing usable yet: the markup is dropped
            elif not (self.stopped_call_whole(body) and self._call(out, body, cut=False)):  # stopped: whole, or text
                self._not_a_call(out, START_TAG + self._buffer)
        elif self._buffer and not truncated:
            self._content(out, self._buffer)
        elif self._buffer:  # a start tag cut off by max_tokens: markup, like the space before it
            self._held_space = ""
        self._buffer = ""
        self._in_call = False
        if self._held_space and not self._after_call.active:
            out.content += self._held_space
        self._held_space = ""
        return out


class HermesToolParser(ToolParser):
    name = "hermes"
    _NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
    _ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        try:
            obj = _loads(body)
        except ValueError:  # cut off by max_tokens (a partial call), or broken (no call)
            return self._partial_call(body) if cut else None
        return self._call_of(obj)

    def _call_of(self, obj) -> ParsedToolCall | None:
        """`{"name": NAME, "arguments": {...}}` ("parameters" also read), NAME one of the tools."""
        if not isinstance(obj, dict) or not self.offers(obj.get("name")):
            return None
        arguments = _object_text(obj.get("arguments", obj.get("parameters")))
        return None if arguments is None else ParsedToolCall(obj["name"], arguments)

    def _partial_call(self, body: str) -> ParsedToolCall | None:
        """A call cut off by max_tokens: its name and the arguments text generated so far ("" when the cut
        came before them: nothing is made up)."""
        name = self._NAME.search(body)
        if not name:
            return None
        try:  # the name as JSON would read it (escapes); raw when the model wrote an invalid escape
            fn_name = json.loads(f'"{name.group(1)}"')
        except json.JSONDecodeError:
            fn_name = name.group(1)
        if not self.offers(fn_name):
            return None
        args = self._ARGS.search(body)
        return ParsedToolCall(fn_name, body[args.end():].rstrip() if args else "", complete=False)


def _object_text(arguments) -> str | None:
    """A call's arguments as JSON object text: an object, or a string holding one (as some models write
    them); missing or null is no arguments. None for anything else, which no client can call with."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return arguments if isinstance(_loads(arguments), dict) else None
        except ValueError:
            return None
    return None


_CALL_SEPARATORS = " \t\r\n;"  # between Llama 3.x calls


class Llama3JsonToolParser(HermesToolParser):
    """Llama 3.x JSON calls: an answer that starts with a JSON object (after an optional `<|python_tag|>`) is
    one or more calls `{"name": ..., "parameters": {...}}`, separated by ';' or whitespace; any other answer
    is text (calls are read only where the answer starts, as the template teaches). A call is emitted as
    soon as its object closes; a JSON object without a name, and text after the calls, stay content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._mode: str | None = None  # None until the answer's first characters decide: "text" | "calls"
        self._decoder = json.JSONDecoder(parse_constant=_reject_non_finite)

    def feed(self, delta: str) -> ParseDelta:
        out = ParseDelta()
        if self._mode == "text":
            out.content = delta
            return out
        self._buffer += delta
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG):].lstrip()
            if not head or self.PYTHON_TAG.startswith(head):
                return out  # only whitespace or a partial tag so far
            self._mode = "calls" if head.startswith("{") else "text"
            if self._mode == "text":
                out.content, self._buffer = self._buffer, ""
                return out
            self._buffer = head
        self._take_calls(out, final=False)
        return out

    def _take_calls(self, out: ParseDelta, final: bool, truncated: bool = False) -> None:
        """Calls from the buffer; `final`: the output ended (`truncated`: by max_tokens, inside a call)."""
        while True:
            rest = self._buffer.lstrip(_CALL_SEPARATORS)  # any run of them, however it was chunked
            if rest.startswith(self.PYTHON_TAG):
                rest = rest[len(self.PYTHON_TAG):]
                self._buffer = rest
                continue
            self._buffer = rest
            if not rest:
                return
            if not rest.startswith("{"):  # text after the calls: the rest of the answer passes as it comes
                if final or not self.PYTHON_TAG.startswith(rest):
                    out.content += rest
                    self._buffer, self._mode = "", "text"
                return
            try:
                _, end = self._decoder.raw_decode(rest)
            except ValueError:
                if final:  # cut off: the name and arguments so far; broken, or no name yet: text
                    if not self._call(out, rest, cut=truncated):
                        out.content += rest
                    self._buffer = ""
                return
            if not self._call(out, rest[:end], cut=False):  # JSON, but no call to one of the tools: text
                out.content += rest[:end]
            self._buffer = rest[end:]

    def finish(self, truncated: bool = False) -> ParseDelta:
        out = ParseDelta()
        if self._mode == "calls":
            self._take_calls(out, final=True, truncated=truncated)
        elif self._buffer and not truncated:
            out.content = self._buffer
        self._buffer, self._mode = "", None
        return out


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
            end = self._VALUE_END.search(body, param.end())
            if end is None and cut:
                break  # value cut off by max_tokens: keep only whole parameters
            stop = end.start() if end else len(body)
            key = param.group(1).strip()
            args[key] = _convert(_strip_newline(body[param.end():stop]), schema.get(key))
            pos = end.end() if end and end.group(0) == "</parameter>" else stop
        # a cut after </function> (in the end tag) left the call whole
        return ParsedToolCall(name, json.dumps(args, ensure_ascii=False), not cut or self.stopped_call_whole(body))

    def stopped_call_whole(self, body: str) -> bool:
        """A call ends with </function> (the grammar's and the template's markup): without it, the model stopped
        mid-call, perhaps before further parameters, so the markup is text, not a call."""
        fn = self._FUNCTION.search(body)
        return fn is not None and "</function>" in body[fn.end():]


class HarmonyToolParser(ToolParser):
    """gpt-oss: a message to `functions.NAME` is a call to NAME, its body the arguments (JSON, as the
    header's `<|constrain|>json` says). The harmony reasoning parser reads the markup, so content arrives
    clean and passes as it is; a call arrives whole when its message ends (with <|call|>). As with the other
    markups, a message that holds no usable call (a function the request did not offer, a body that is no
    JSON object) is the model's text: its body is content."""

    name = "harmony"

    def feed(self, delta: str) -> ParseDelta:
        return ParseDelta(content=delta)

    def function_message(self, message: FunctionMessage, truncated: bool = False) -> ParseDelta:
        """`truncated`: max_tokens cut the output, so a message that did not end is a partial call (its name and
        the arguments so far); one the model stopped in without ending it is a call only if its body is whole."""
        if not self.offers(message.name):
            return ParseDelta(content=message.arguments)
        if message.complete or not truncated:
            arguments = _object_text(message.arguments or None)  # an empty body: no arguments
            if arguments is None:
                return ParseDelta(content=message.arguments)
            call = ParsedToolCall(message.name, arguments)
        else:
            call = ParsedToolCall(message.name, message.arguments, complete=False)
        self.num_calls += 1
        return ParseDelta(tool_calls=[call])

    def finish(self, truncated: bool = False) -> ParseDelta:
        return ParseDelta()


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
    except (ValueError, KeyError):
        return value


PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    HarmonyToolParser.name: HarmonyToolParser,
}


def parse_tool_calls(parser: ToolParser, text: str, truncated: bool = False) -> ParseDelta:
    """Non-streaming: the whole text through the same scanner streaming uses."""
    out = parser.feed(text)
    out += parser.finish(truncated)
    return out
