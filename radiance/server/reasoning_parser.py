"""Split `<think>...</think>` reasoning from the answer, incrementally (same result for any chunking).

The output may open its own `<think>` block (after optional whitespace) or, when the chat template
already opened one in the prompt (Qwen3 style), start inside it. Without a `</think>` everything
after the opening is reasoning (a generation cut off while thinking has no answer yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from radiance.server.streaming_text import LeadingSpaceEater, partial_tag_start

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ThinkReasoningParser:
    name = "think"

    def __init__(self, starts_inside: bool = False):
        self._state = "reasoning" if starts_inside else "start"
        self._buffer = ""
        self._eat_space = LeadingSpaceEater(active=starts_inside)

    def feed(self, delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += delta
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(OPEN_TAG):
                self._state = "reasoning"
                self._buffer = head[len(OPEN_TAG):]
                self._eat_space.active = True
            elif not head or OPEN_TAG.startswith(head):
                return out  # could still become <think>
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(CLOSE_TAG)
            if end >= 0:
                out.reasoning = self._eat_space(self._buffer[:end])
                self._buffer = self._buffer[end + len(CLOSE_TAG):]
                self._state = "content"
                self._eat_space = LeadingSpaceEater(active=True)
            else:
                keep = partial_tag_start(self._buffer, CLOSE_TAG)
                out.reasoning = self._eat_space(self._buffer[:keep])
                self._buffer = self._buffer[keep:]
                return out
        out.content = self._eat_space(self._buffer)
        self._buffer = ""
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == "reasoning":
            out.reasoning = self._eat_space(self._buffer)
        else:  # "start" with only whitespace or a partial "<thi": plain content
            out.content = self._eat_space(self._buffer)
        self._buffer = ""
        return out


PARSERS = {ThinkReasoningParser.name: ThinkReasoningParser}


def split_reasoning(parser: ThinkReasoningParser, text: str) -> ReasoningDelta:
    """Non-streaming: the whole text through the same incremental parser."""
    first = parser.feed(text)
    last = parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
