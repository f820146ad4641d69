"""gpt-oss's harmony calls: a message to `functions.NAME`, which the harmony reasoning parser hands over whole."""

from __future__ import annotations

from radiance.server.reasoning_parser import FunctionMessage
from radiance.server.tool_parsers.base import ParseDelta, ParsedToolCall, ToolParser, _object_text

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
