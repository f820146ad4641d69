"""Small helpers shared by the incremental parsers (tool calls, reasoning)."""

from __future__ import annotations


def partial_tag_start(text: str, tag: str) -> int:
    """Index where a suffix of `text` that could be the beginning of `tag` starts (len(text) if none).

    Parsers hold such a suffix back until the next chunk says whether the tag really begins there."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class LeadingSpaceEater:
    """Drops whitespace at the start of a segment, however the segment is split into chunks."""

    def __init__(self, active: bool = False):
        self.active = active

    def __call__(self, text: str) -> str:
        if not self.active:
            return text
        stripped = text.lstrip()
        if stripped:
            self.active = False
        return stripped
