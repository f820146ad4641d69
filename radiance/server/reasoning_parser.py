"""Split reasoning from the answer, incrementally (same result for any chunking).

`think`: the output may open its own `<think>` block (after optional whitespace) or, when the chat
template already opened one in the prompt (Qwen3 style), start inside it (a `<think>` the model writes
there again is dropped, as vLLM does). Without a `</think>` everything after the opening is reasoning (a
generation cut off while thinking has no answer yet).

`harmony` (gpt-oss): the output is a series of messages, `<|start|>assistant<|channel|>NAME<|message|>
BODY<|end|>` (the first without `<|start|>assistant`, which ends the prompt); `analysis` bodies are
reasoning, every other channel's bodies content, except a message addressed to a recipient (`to=...` in its
header). One to a developer function (`to=functions.NAME`, ending `<|call|>`) comes out whole as a
FunctionMessage, for the harmony tool-call parser to make a call of; one to any other recipient (gpt-oss's
built-in tools: `to=browser.search`, `to=python`, ...) is reasoning, as vLLM's harmony output reads built-in
tool calls: this server runs no built-in tool, so such a message is neither a call nor answer text. Bodies
that land in one field are joined with MESSAGE_SEPARATOR. Its markers are special tokens, so a request it
serves must keep special tokens in the text (`needs_special_tokens`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from radiance.server.streaming_text import LeadingSpaceEater, partial_tag_start

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass
class FunctionMessage:
    """A harmony message to `functions.NAME`: the model calls NAME with the message's body."""

    name: str
    arguments: str
    complete: bool = True  # False: the output ended inside the body (no <|call|>)
    at: int = 0  # where it came among the content of its ReasoningDelta (that content[:at] came before it)
    # whether a message of the content came before it: the parser then sets the next one apart (if its body
    # turns out to be text, ChoiceStream sets that apart itself)
    content_before: bool = False


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""
    function_messages: list[FunctionMessage] = field(default_factory=list)  # harmony only

    def extend(self, later: "ReasoningDelta") -> None:
        """Appends what a later delta parsed, its function messages kept in their place among the content."""
        for message in later.function_messages:
            message.at += len(self.content)
        self.reasoning += later.reasoning
        self.content += later.content
        self.function_messages += later.function_messages


class ReasoningParser(Protocol):
    name: str
    needs_special_tokens: bool  # its markup is special tokens, which the detokenizer drops by default

    def feed(self, delta: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ThinkReasoningParser:
    name = "think"
    needs_special_tokens = False
    open_tag, close_tag = OPEN_TAG, CLOSE_TAG

    def __init__(self, starts_inside: bool = False):
        # "start": the output may open <think>; "inside": the prompt opened it (the model may repeat it)
        self._state = "inside" if starts_inside else "start"
        self._buffer = ""
        self._eat_space = LeadingSpaceEater(active=starts_inside)

    def feed(self, delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += delta
        if self._state in ("start", "inside"):
            head = self._buffer.lstrip()
            if head.startswith(self.open_tag):
                self._state = "reasoning"
                self._buffer = head[len(self.open_tag):]
                self._eat_space.active = True
            elif not head or self.open_tag.startswith(head):
                return out  # could still become <think>
            else:
                self._state = "reasoning" if self._state == "inside" else "content"
        if self._state == "reasoning":
            end = self._buffer.find(self.close_tag)
            if end >= 0:
                out.reasoning = self._eat_space(self._buffer[:end])
                self._buffer = self._buffer[end + len(self.close_tag):]
                self._state = "content"
                self._eat_space = LeadingSpaceEater(active=True)
            else:
                keep = partial_tag_start(self._buffer, self.close_tag)
                out.reasoning = self._eat_space(self._buffer[:keep])
                self._buffer = self._buffer[keep:]
                return out
        out.content = self._eat_space(self._buffer)
        self._buffer = ""
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state in ("reasoning", "inside"):
            out.reasoning = self._eat_space(self._buffer)
        else:  # "start" with only whitespace or a partial "<thi": plain content
            out.content = self._eat_space(self._buffer)
        self._buffer = ""
        return out


class MistralReasoningParser(ThinkReasoningParser):
    name = "mistral"
    needs_special_tokens = True  # [THINK] and [/THINK] are control tokens
    open_tag, close_tag = "[THINK]", "[/THINK]"


START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
# <|return|>, <|call|> and <|endoftext|> are gpt-oss's EOS tokens: the last message ends with one
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
HARMONY_MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *MESSAGE_ENDS)
_MARKER = re.compile("|".join(re.escape(marker) for marker in HARMONY_MARKERS))
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
# the recipient, before or after the channel: `to=functions.get_weather<|channel|>...`,
# `... to=functions.f <|constrain|>`
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."  # the namespace of the developer's functions; other recipients are built-in tools
# Text outside messages that may still be the start of a header: the prompt ends with `<|start|>assistant`,
# so the model may go on with ` to=functions.f` before the header's first marker. Every prefix of such a
# text matches too, so the guess fails the same way however the text is chunked.
_HEADER_START = re.compile(r"\s*(t|to|to=\S*\s*)?")
MESSAGE_SEPARATOR = "\n\n"  # between two messages that land in the same field (e.g. a preamble and the answer)


class HarmonyReasoningParser:
    """Message bodies go to their channel's field; headers and markers are dropped. Text outside any
    message (a model that ignores the format) is content, set apart like a message (_stray_text); a message cut
    off is flushed to its field.
    A message to a function is held until it ends, then handed on whole (ReasoningDelta.function_messages)."""

    name = "harmony"
    needs_special_tokens = True

    def __init__(self, starts_inside: bool = False):  # a <think> left open in the prompt means nothing here
        self._buffer = ""  # text not parsed yet: at most the start of a marker
        self._mode = "outside"  # outside a message, in its header, or in its body
        self._header_guess: str | None = ""  # outside text held as a possible header; None once it cannot be
        self._header = ""
        self._field = "content"  # where the current body goes (unless it is a function's arguments)
        self._function: FunctionMessage | None = None  # the function message being read
        self._body_started = False
        self._filled = {"reasoning": False, "content": False}
        self._after_message = False  # a message (or a marker that ends one) came: outside text is between messages
        self._stray_started = False  # outside text of the current stretch went out as content
        self._stray_space = ""  # trailing whitespace of that text, dropped if a message follows

    def feed(self, delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += delta
        while (marker := _MARKER.search(self._buffer)) is not None:
            self._text(self._buffer[:marker.start()], out)
            self._marker(marker.group(), out)
            self._buffer = self._buffer[marker.end():]
        keep = min(partial_tag_start(self._buffer, marker) for marker in HARMONY_MARKERS)
        self._text(self._buffer[:keep], out)
        self._buffer = self._buffer[keep:]
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        self._text(self._buffer, out)  # the start of a marker that never came is text
        self._buffer = ""
        self._leave_message(out, complete=False)  # held outside text is content; an unfinished header is dropped
        self._emit("content", self._stray_space, out)  # outside text that ends the output keeps its spacing
        self._stray_space = ""
        return out

    def _text(self, text: str, out: ReasoningDelta) -> None:
        if self._mode == "header":
            self._header += text
        elif self._mode == "body":
            self._body_text(text, out)
        else:
            self._outside_text(text, out)

    def _marker(self, marker: str, out: ReasoningDelta) -> None:
        if marker in MESSAGE_ENDS:
            self._leave_message(out)
        elif marker == START:
            self._leave_message(out)
            self._open_header("")
        elif self._mode == "outside":  # a header the model began without <|start|> (always the first one)
            self._open_header(self._header_guess or "")
            self._header_marker(marker)
        elif self._mode == "header":
            self._header_marker(marker)
        elif marker == CHANNEL:  # a new header right after a body, with no <|end|><|start|> between
            self._leave_message(out)
            self._open_header("")
            self._header_marker(marker)
        # <|message|> and <|constrain|> inside a body mean nothing: dropped

    def _open_header(self, text: str) -> None:
        self._mode, self._header = "header", text
        self._stray_started, self._stray_space = False, ""  # a header began: outside text before it has ended

    def _header_marker(self, marker: str) -> None:
        if marker != MESSAGE:
            self._header += marker  # kept so the channel name can be found after <|channel|>
            return
        channel = _CHANNEL_NAME.search(self._header)
        recipient = _RECIPIENT.search(self._header)
        to = recipient.group(1) if recipient else None
        function = to is not None and to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS)
        self._function = FunctionMessage(to[len(FUNCTIONS):], "") if function else None
        # a built-in tool's call is the model's own work, like its analysis (no tool here runs it)
        analysis = channel is not None and channel.group(1) == "analysis"
        self._field = "reasoning" if analysis or (to is not None and not function) else "content"
        self._mode, self._body_started = "body", False

    def _leave_message(self, out: ReasoningDelta, complete: bool = True) -> None:
        """`complete`: the message ended with a marker, not with the output."""
        if self._mode == "outside" and self._header_guess and not self._header_guess.isspace():
            self._stray_text(self._header_guess, out)  # it never became a header
        if self._mode == "body" and self._function is not None:
            self._function.arguments = self._function.arguments.strip()
            self._function.complete = complete
            self._function.at = len(out.content)
            self._function.content_before = self._filled["content"]
            out.function_messages.append(self._function)
            self._function = None
        if complete:  # finish() gives back the trailing space of outside text that ends the output
            self._stray_started, self._stray_space = False, ""
        self._mode, self._header_guess, self._after_message = "outside", "", True

    def _outside_text(self, text: str, out: ReasoningDelta) -> None:
        if self._header_guess is not None:
            self._header_guess += text
            if _HEADER_START.fullmatch(self._header_guess):
                return
            text, self._header_guess = self._header_guess, None
        self._stray_text(text, out)

    def _stray_text(self, text: str, out: ReasoningDelta) -> None:
        """Text outside any message. Harmony has none: after a message's end only <|start|> may come (openai-harmony's
        parser fails on anything else, and vLLM with it). Rather than fail or lose the model's words, such text is
        content, set apart like a message of its own (MESSAGE_SEPARATOR after earlier content; it was glued on:
        "Hi" + "to" gave "Hito"); the whitespace between it and a message is formatting, dropped, as is outside text
        that is only whitespace (it gave content " " beside a call). An output that ignores the format (no message
        before its text) keeps its text as written."""
        if not self._stray_started:
            if self._after_message:
                text = text.lstrip()
            if not text:
                return
            self._stray_started = True
            if self._filled["content"]:
                text = MESSAGE_SEPARATOR + text
        text = self._stray_space + text
        kept = text.rstrip()
        self._stray_space = text[len(kept):]
        self._emit("content", kept, out)

    def _body_text(self, text: str, out: ReasoningDelta) -> None:
        if self._function is not None:
            self._function.arguments += text
            return
        if text and not self._body_started:
            self._body_started = True
            if self._filled[self._field]:
                text = MESSAGE_SEPARATOR + text
        self._emit(self._field, text, out)

    def _emit(self, field: str, text: str, out: ReasoningDelta) -> None:
        if text:
            self._filled[field] = True
            setattr(out, field, getattr(out, field) + text)


PARSERS = {parser.name: parser for parser in (ThinkReasoningParser, MistralReasoningParser, HarmonyReasoningParser)}


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """Non-streaming: the whole text through the same incremental parser."""
    out = parser.feed(text)
    out.extend(parser.finish())
    return out
