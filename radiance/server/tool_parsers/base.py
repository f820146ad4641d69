"""What every tool-call parser shares: the parsed call, the delta a chunk of text gives, and the incremental
scanner for markups whose calls sit between a start and an end tag (Hermes, Qwen3-coder)."""

from __future__ import annotations

import json
import uuid
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
    needs_special_tokens = False  # its markup is special tokens, which the detokenizer drops by default

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self._buffer = ""
        self._in_call = False
        self._end_search_from = 0  # in a call: where the search for its end tag goes on
        self._body_sent: int | None = None  # in a call that can never be one: how much of the buffer went out as text
        self._body_looked = 0  # in a call: how long its body was when body_broken last looked at it
        self._held_space = ""  # trailing whitespace of content, dropped if a call follows
        self._space_before_call = ""  # that whitespace, given back if the call turns out to be text
        self._after_call = LeadingSpaceEater()
        self._space_after_call = ""  # whitespace after a call, given back if content follows content
        self._content_sent = False
        self.num_calls = 0

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        """One call's body -> the parsed call, None when it is no usable call; each format defines it. `cut`:
        max_tokens ended the output inside the call, so a partial call is read from what was generated."""
        raise TypeError(f"{type(self).__name__} must define parse_call")

    def new_call_id(self) -> str:
        """The id of a call this parser read (OpenAI's shape)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def offers(self, name) -> bool:
        """A call must name one of the request's tools (a parser made without tools takes any name)."""
        return isinstance(name, str) and (not self.tools or name in self.tools)

    def _content(self, out: ParseDelta, text: str) -> None:
        if self._after_call.active:
            kept = self._after_call(text)
            self._space_after_call += text[:len(text) - len(kept)]
            if not kept:
                return
            if self._content_sent:  # text on both sides of the calls: keep them apart ("Hi\n\nbye", not "Hibye")
                kept = (self._space_after_call or self._space_before_call) + kept
            self._space_after_call, text = "", kept
        if not text:
            return
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        out.content += body
        self._content_sent = self._content_sent or bool(body)

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
                end = self._buffer.find(END_TAG, self._end_search_from)
                while end >= 0 and not self.end_tag_closes(self._buffer[:end]):
                    end = self._buffer.find(END_TAG, end + 1)  # the end tag is written inside the call
                if end < 0:  # searched up to here: a long call is not rescanned from its start on every piece
                    self._end_search_from = max(self._end_search_from, len(self._buffer) - len(END_TAG) + 1)
                    self._release_text_body(out, final=False)
                    break
                body, markup_end = self._buffer[:end], end + len(END_TAG)
                text_from, self._body_sent = self._body_sent, None
                self._buffer, rest = self._buffer[markup_end:], self._buffer
                self._in_call = False
                if text_from is not None:  # text already: the rest of it, end tag and all, is too
                    self._content(out, rest[text_from:markup_end])
                elif self.stopped_call_whole(body) and self._call(out, body, cut=False):  # whole, or text
                    self._after_call.active = True
                else:
                    self._not_a_call(out, START_TAG + body + END_TAG)
                continue
            start = self._buffer.find(START_TAG)
            if start >= 0:
                self._content(out, self._buffer[:start])
                self._space_before_call, self._held_space = self._held_space, ""
                self._space_after_call = ""
                self._buffer = self._buffer[start + len(START_TAG):]
                self._in_call = True
                self._end_search_from, self._body_sent, self._body_looked = 0, None, 0
                continue
            keep = partial_tag_start(self._buffer, START_TAG)
            self._content(out, self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            break
        return out

    def _release_text_body(self, out: ParseDelta, final: bool) -> bool:
        """A call's body that can never be a call (`body_broken`) is text already: it goes out as it comes, not at
        its end tag or at finish() (the same content, only sooner). Whether it went. Until `final`, a body is looked
        at again only once it has doubled: linear in all however long the call (a long one was decoded on every
        piece), and a body that breaks goes out by the time as much text follows the break as came before it."""
        if self._body_sent is None:
            if not final and len(self._buffer) < 2 * self._body_looked:
                return False
            self._body_looked = len(self._buffer)
            keep = partial_tag_start(self._buffer, END_TAG)  # a partial end tag is no part of the body
            if not self.body_broken(self._buffer[:keep] if keep < len(self._buffer) else self._buffer):
                return False
            self._not_a_call(out, START_TAG)
            self._body_sent = 0
        # all of it: its end tag, when it comes, is text too (the tag is only looked for, to leave the call there)
        self._content(out, self._buffer[self._body_sent:])
        self._body_sent = len(self._buffer)
        return True

    def body_broken(self, body: str) -> bool:
        """Whether no text after `body`, the start of a call's body, can make it a call, however the call ends (end
        tag, stop, or a cut by max_tokens, whose partial call needs a body that may still become one). A format
        that cannot tell says False: the body is held until its call ends."""
        return False

    def end_tag_closes(self, body: str) -> bool:
        """Whether an end tag after `body` ends the call; a format says no where the tag sits inside the call (a
        JSON string, a parameter value that quotes the markup), and the scan goes on to the next one."""
        return True

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
            if self._release_text_body(out, final=True):
                pass  # a body no call can be made of: text, cut or not (all of it, as it streamed)
            elif truncated:
                self._call(out, body.rstrip(), cut=True)  # nothing usable yet: the markup is dropped
            elif not (self.stopped_call_whole(body) and self._call(out, body, cut=False)):  # stopped: whole, or text
                self._not_a_call(out, START_TAG + self._buffer)
        elif self._buffer and not truncated:
            self._content(out, self._buffer)
        elif self._buffer:  # a start tag cut off by max_tokens: markup, like the space before it
            self._held_space = ""
        self._buffer = ""
        self._in_call, self._body_sent = False, None
        if self._held_space and not self._after_call.active:
            out.content += self._held_space
        self._held_space = ""
        return out


def _object_text(arguments) -> str | None:
    """A call's arguments as JSON object text: an object, or a string holding one (as some models write
    them); missing or null is no arguments. None for anything else, which no client can call with."""
    if arguments is None:
        return "{}"
    try:
        if isinstance(arguments, dict):
            return json.dumps(arguments, ensure_ascii=False)
        if isinstance(arguments, str):
            return arguments if isinstance(_loads(arguments), dict) else None
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json reads or writes (a 500 otherwise)
        return None
    return None
