"""Mistral's calls, after its `[TOOL_CALLS]` token. Two shapes, by tokenizer version:
  - up to v7 (Mistral-7B v0.3, Nemo, Small 3.1): one JSON array of calls, `[TOOL_CALLS] [{"name": NAME,
    "arguments": {...}}, ...]` (an "id" key the model may add is ignored);
  - from v11 on (Small 3.2, Magistral, Devstral): a marker per call, `[TOOL_CALLS]NAME[ARGS]{...}`, some templates
    with `[CALL_ID]ID` before `[ARGS]`.
The markers are special tokens, so the server keeps special tokens in the text this parser reads
(`needs_special_tokens`). Text before a marker is content, each call is emitted as soon as its JSON object closes,
and text after the calls is content again. Markup that gives no usable call (broken JSON, a function the request did
not offer, a name with a space in it) is the model's text, as with the other formats: it goes out as content, the
markup read before it included; in an array that gives calls, an object that is no call is content alone (held
until the array gives its first call or ends). An object whose JSON syntax breaks is text as soon as it does, and so
is the rest of the output (both went out at the end before). Calls get 9-character alphanumeric ids, the only ones
Mistral's templates take back.
"""

from __future__ import annotations

import re
import secrets
import string

from radiance.server.streaming_text import partial_tag_start
from radiance.server.tool_parsers.base import ParseDelta, ParsedToolCall, _object_text
from radiance.server.tool_parsers.json_calls import _SHORT_JSON, HermesToolParser, _broken_structure

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9
_BETWEEN_CALLS = " \t\r\n,"  # in the array
_NAME = re.compile(r"[^\s\[\]{}]*")  # a v11 call's function name: up to [ARGS], [CALL_ID] or its arguments
_CALL_ID = re.compile(re.escape(CALL_ID) + r"[^\s\[\]{}]*")


class MistralToolParser(HermesToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        # text | opened (right after a marker) | array | name | arguments | broken (the rest is text)
        self._state = "text"
        self._markup = ""  # markup read since the marker that has given no call yet: text if none comes
        self._group_calls = 0  # calls the current array gave
        self._rejected: list[str] = []  # objects of the current array that are no call, held while none was one
        self._function = ""  # the v11 call's function name, once read
        self._may_close = False  # the piece being read has a '}': an object may have closed (feed)
        self._steps = {"text": self._in_text, "opened": self._in_opened, "array": self._in_array,
                       "name": self._in_name, "arguments": self._in_arguments, "broken": self._in_broken}

    def new_call_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))

    def feed(self, delta: str) -> ParseDelta:
        out = ParseDelta()
        self._buffer += delta
        # a JSON object can only close with a '}': without one, decoding the buffer again is wasted (a long call
        # streamed token by token was decoded from its start on every piece: quadratic)
        self._may_close = "}" in delta
        while self._steps[self._state](out):
            pass
        return out

    # each state's step reads what the buffer decides; False: it needs more text

    def _in_text(self, out: ParseDelta) -> bool:
        start = self._buffer.find(MARKER)
        if start < 0:
            keep = partial_tag_start(self._buffer, MARKER)
            self._content(out, self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            return False
        self._content(out, self._buffer[:start])
        self._space_before_call, self._held_space = self._held_space, ""
        self._markup, self._buffer, self._state = MARKER, self._buffer[start + len(MARKER):], "opened"
        self._group_calls, self._rejected = 0, []
        return True

    def _in_opened(self, out: ParseDelta) -> bool:
        rest = self._buffer.lstrip()
        if not rest:
            return False
        self._markup += self._buffer[:len(self._buffer) - len(rest)]
        if rest.startswith("["):
            self._markup += "["
            self._buffer, self._state = rest[1:], "array"
        else:
            self._buffer, self._state = rest, "name"
        return True

    def _in_array(self, out: ParseDelta) -> bool:
        rest = self._buffer.lstrip(_BETWEEN_CALLS)
        self._markup += self._buffer[:len(self._buffer) - len(rest)]
        self._buffer = rest
        if not rest:
            return False
        if rest.startswith("]"):
            self._buffer, self._state = rest[1:], "text"
            if self._group_calls:
                self._markup = ""
            else:  # an array that gave no call is text, its closing too
                self._text_instead(out, "]")
            return True
        if not rest.startswith("{"):  # no call list after all: the rest is text
            return self._back_to_text(out)
        if not (self._may_close or len(rest) < _SHORT_JSON):
            return False
        try:
            obj, end = self._decoder.raw_decode(rest)
        except (ValueError, RecursionError) as exc:  # not whole yet (finish decides if it never closes), or broken
            return self._broken(out, exc, rest)
        call = self._call_of(obj)
        if call is None and not self._group_calls:
            # held: text with the whole array if no item is a call, the object alone if one is
            self._markup += rest[:end]
            self._rejected.append(rest[:end])
        elif call is None:  # an array of calls: the object is the model's text, its separators are not
            self._markup = ""
            self._text_instead(out, rest[:end])
        else:
            if self._rejected:  # the objects before the first call, without the array's markup
                self._markup = ""
                self._text_instead(out, " ".join(self._rejected))
                self._rejected = []
            self._emit(out, call)
            self._group_calls += 1
        self._buffer = rest[end:]
        return True

    def _in_name(self, out: ParseDelta) -> bool:
        name = _NAME.match(self._buffer).group(0)
        after = self._buffer[len(name):]
        call_id = _CALL_ID.match(after)
        if call_id:
            after = after[call_id.end():]
        if not after:
            return False
        if after.startswith(ARGS) or (name and after.startswith("{")):
            args_at = len(self._buffer) - len(after) + (len(ARGS) if after.startswith(ARGS) else 0)
            self._markup += self._buffer[:args_at]
            self._function, self._buffer, self._state = name, self._buffer[args_at:], "arguments"
            return True
        if ARGS.startswith(after) or (not call_id and CALL_ID.startswith(after)):
            return False  # a marker may be coming
        return self._back_to_text(out)  # a name with a space in it, or no name: text

    def _in_arguments(self, out: ParseDelta) -> bool:
        rest = self._buffer.lstrip()
        if not rest:
            return False
        if not rest.startswith("{"):
            return self._back_to_text(out)
        if not (self._may_close or len(rest) < _SHORT_JSON):
            return False
        try:
            obj, end = self._decoder.raw_decode(rest)
        except (ValueError, RecursionError) as exc:
            return self._broken(out, exc, rest)
        arguments = _object_text(obj) if self.offers(self._function) and isinstance(obj, dict) else None
        if arguments is None:
            self._text_instead(out, rest[:end])
        else:
            self._emit(out, ParsedToolCall(self._function, arguments))
        self._buffer, self._state = rest[end:], "text"
        return True

    def _broken(self, out: ParseDelta, exc: Exception, rest: str) -> bool:
        """An object whose JSON syntax broke before its end is no call, whatever follows: it is text now, with the
        markup before it and the rest of the output (all held to finish() before, which made them text)."""
        if not _broken_structure(exc, rest):
            return False  # not whole yet
        self._text_instead(out, self._buffer)
        self._buffer, self._state = "", "broken"
        return True

    def _in_broken(self, out: ParseDelta) -> bool:
        self._content(out, self._buffer)
        self._buffer = ""
        return False

    def _emit(self, out: ParseDelta, call: ParsedToolCall) -> None:
        out.tool_calls.append(call)
        self.num_calls += 1
        self._markup = ""
        self._after_call.active = True

    def _back_to_text(self, out: ParseDelta) -> bool:
        """The markup read since the marker gave no call: it is text, and so is what follows it."""
        self._text_instead(out, "")
        self._state = "text"
        return True

    def _text_instead(self, out: ParseDelta, text: str) -> None:
        """`text` is the model's text, not a call; so is the markup read before it that gave no call yet."""
        if self._markup:
            self._held_space, self._space_before_call = self._space_before_call, ""
            text, self._markup = self._markup + text, ""
        self._content(out, text)

    def finish(self, truncated: bool = False) -> ParseDelta:
        """End of generation; `truncated`: max_tokens cut it, so a call it cut is read from what was generated (its
        name and arguments so far) and a cut marker is markup; otherwise markup that gave no call is text."""
        out = ParseDelta()
        rest = self._buffer.strip()
        if self._state in ("array", "arguments") and rest.startswith("{"):
            # feed decodes a long object only at a '}', so a break it has not seen is told here: the same result
            # however the output was chunked (a cut read the broken object as a partial call)
            try:
                self._decoder.raw_decode(rest)
            except (ValueError, RecursionError) as exc:
                self._broken(out, exc, rest)
        if self._state == "text" and self._buffer:  # a partial marker: text, or markup a cut ended (and its space)
            if truncated:
                self._held_space = ""
            else:
                self._content(out, self._buffer)
        elif self._state == "array" and truncated:
            call = self._partial_call(rest) if rest else None
            if self._rejected:  # objects no call, held: text as where a call follows them
                self._markup = ""
                self._text_instead(out, " ".join(self._rejected))
            if call is not None:
                self._emit(out, call)
        elif self._state == "arguments" and truncated:
            if self.offers(self._function):
                self._emit(out, ParsedToolCall(self._function, rest, complete=False))
        elif self._state not in ("text", "broken") and not truncated and (rest or not self._group_calls):
            self._text_instead(out, self._buffer)  # a call the model stopped in, or a marker with no call
        self._buffer, self._state, self._markup, self._rejected = "", "text", "", []
        if self._held_space and not self._after_call.active:
            out.content += self._held_space
        self._held_space = ""
        return out
