"""Calls written as JSON: Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and Llama 3.x (an
answer that is `{"name": ..., "parameters": {...}}`)."""

from __future__ import annotations

import json
import re

from radiance.server.tool_parsers.base import (ParseDelta, ParsedToolCall, ToolParser, _loads, _object_text,
                                               _reject_non_finite)

def in_json_string(text: str) -> bool:
    """Whether JSON text ends inside a string literal (an odd count of unescaped quotes)."""
    inside, escaped = False, False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


class HermesToolParser(ToolParser):
    name = "hermes"
    _NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
    _ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._decoder = json.JSONDecoder(parse_constant=_reject_non_finite)

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        try:
            obj = _loads(body)
        except RecursionError:  # nested too deep to read: no call, cut or not (body_broken says so too)
            return None
        except ValueError:  # cut off by max_tokens (a partial call), or broken (no call)
            return self._partial_call(body) if cut else None
        return self._call_of(obj)

    def end_tag_closes(self, body: str) -> bool:
        """A </tool_call> inside a JSON string (an argument that writes the markup) does not end the call."""
        return not in_json_string(body)

    def body_broken(self, body: str) -> bool:
        """No JSON object (a stray <tool_call> in prose: " tag. ..."), one whose syntax broke before its end
        ("{Note} ..."), or a whole object with more than whitespace after it (`{...} junk`, `{...}}`, a second
        object): text whatever follows, released as it comes rather than held to its end tag or the end. Such a
        body is no call at its end tag or a stop either (it is no JSON document); a cut by max_tokens read it as
        a partial call whose arguments ran on into the junk."""
        start = _JSON_SPACE.match(body).end()
        if start == len(body):
            return False
        if body[start] != "{":
            return True
        try:
            _, end = self._decoder.raw_decode(body, start)
        except (ValueError, RecursionError) as exc:
            return _broken_structure(exc, body)
        # a whole object: a call if only (JSON) whitespace follows it, whatever ends the call; json.loads, which
        # reads the body at its end tag or a stop, refuses anything else after it
        return _JSON_SPACE.match(body, end).end() < len(body)

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


_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # the whitespace JSON allows around values
_SHORT_JSON = 4096  # a JSON call shorter than this is decoded on every piece (broken JSON is told at once)
_CALL_SEPARATORS = " \t\r\n;"  # between Llama 3.x calls


# characters at which a JSON decode error may only mean "unfinished": a literal or number still being written
# (`tr` of true, `1.` of 1.5, `-` of -2)
_MAY_CONTINUE = frozenset("truefalsn0123456789+-.eE")


def _broken_json(exc: Exception, text: str) -> bool:
    """Whether JSON `text` failed to parse before its end (a syntax error no continuation fixes), not because
    it is unfinished: an unterminated string, an error at the end of the text, or one at a literal or number
    being written may still become an object."""
    if isinstance(exc, RecursionError):  # nested deeper than the decoder reads: no continuation makes it a call
        return True
    if not isinstance(exc, json.JSONDecodeError) or exc.msg.startswith("Unterminated string"):
        return False
    return exc.pos < len(text.rstrip()) and text[exc.pos] not in _MAY_CONTINUE


def _broken_structure(exc: Exception, text: str) -> bool:
    """_broken_json where the syntax between the values broke ("Expecting ..."), the break prose makes. An error
    inside a string (an invalid escape, a raw newline) is no such break: a cut by max_tokens still reads the
    partial call such a body writes, so it is held."""
    if isinstance(exc, RecursionError):  # too deep to read, as in _broken_json (a RecursionError has no .msg)
        return True
    return _broken_json(exc, text) and exc.msg.startswith(("Expecting", "Illegal trailing comma"))


class Llama3JsonToolParser(HermesToolParser):
    """Llama 3.x JSON calls: an answer that starts with a JSON object (after an optional `<|python_tag|>`) is
    one or more calls `{"name": ..., "parameters": {...}}`, separated by ';' or whitespace; any other answer
    is text (calls are read only where the answer starts, as the template teaches). A call is emitted as
    soon as its object closes; a JSON object that is no call, and the text after it or after the calls, stay
    content; an opening '{' whose JSON breaks is text at once (not held to the end of the answer)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._mode: str | None = None  # None until the answer's first characters decide: "text" | "calls"

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
        # decoding the whole buffer again on every piece is quadratic in a long call: past a few KB, only a '}'
        # (an object may close) is worth it, so broken JSON that long is told at its next '}'
        self._take_calls(out, final=False, decode="}" in delta or len(self._buffer) < _SHORT_JSON)
        return out

    def _take_calls(self, out: ParseDelta, final: bool, truncated: bool = False, decode: bool = True) -> None:
        """Calls from the buffer; `final`: the output ended (`truncated`: by max_tokens, inside a call); `decode`:
        whether an unfinished object is worth decoding again."""
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
            if not (final or decode):
                return
            try:
                _, end = self._decoder.raw_decode(rest)
            except (ValueError, RecursionError) as exc:
                if final:  # cut off: the name and arguments so far; broken (as feed tells it), or no name yet: text
                    if _broken_json(exc, rest) or not self._call(out, rest, cut=truncated):
                        out.content += rest
                    self._buffer = ""
                elif _broken_json(exc, rest):  # no more text makes it a call: release it now, not at the end
                    out.content += rest
                    self._buffer, self._mode = "", "text"
                return
            if not self._call(out, rest[:end], cut=False):  # JSON, but no call to one of the tools: text, and so
                out.content += rest                         # is the rest of the answer, its spacing kept
                self._buffer, self._mode = "", "text"
                return
            self._buffer = rest[end:]

    def finish(self, truncated: bool = False) -> ParseDelta:
        out = ParseDelta()
        if self._mode == "calls":
            self._take_calls(out, final=True, truncated=truncated)
        elif self._buffer and not truncated:
            out.content = self._buffer
        self._buffer, self._mode = "", None
        return out
