"""Tool-call parsers: turn model text with tool-call markup into OpenAI tool calls.

Five markups in the text: Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Qwen3-coder
(`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`), GLM-4.5
(`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`), Llama 3.x (an answer
that is `{"name": ..., "parameters": {...}}`, Llama3JsonToolParser) and Mistral (`[TOOL_CALLS] [{...}, ...]`, or
`[TOOL_CALLS]NAME[ARGS]{...}` per call, MistralToolParser). gpt-oss's harmony format calls a function with a
message of its own, which the harmony reasoning parser hands over whole (HarmonyToolParser). One module per format;
`base` holds the scanner the tagged formats share.

One incremental scanner serves both streaming and non-streaming requests (both feed it each engine output
as it arrives; a non-streaming answer is the sum of the pieces), so both give the same result by construction.
Text outside calls streams out as content; a possible start tag at a chunk's end is held back until the next
chunk decides; a call is emitted whole when its end tag arrives. Markup that no further text can make a call
(JSON whose syntax broke before its end: `{Note} ...`, a whole object with more than whitespace after it:
`{...} junk`, a stray `<tool_call>` in prose) streams out as content as it comes, not at its end tag or the end
of the output. A call cut off by max_tokens is parsed at `finish()`
from what was generated, its markup never reaching the content. Whitespace that only separates content from
calls is dropped.

A call must be usable: it names one of the request's tools and its arguments are a JSON object. Markup that
is no such call (broken JSON, another name, a list for arguments, a tag the model opened and never closed
before it stopped) is the model's text, and goes out as content unchanged, as vLLM returns it. A call the
model stopped in (its end tag never came, and max_tokens did not cut it) is a call only when it is whole
(`stopped_call_whole`: its JSON parses; a Qwen3-coder call has its `</function>`), as a harmony message
the model stopped in is; otherwise it is text. (vLLM's qwen3_coder parser also takes a `<function=` left
open as a call, parameters and all; a call cut short is no call its client can trust.) The same holds when the end
tag comes. An end tag the call writes inside itself (a JSON string, a Qwen3-coder parameter value quoting the
markup) does not end it (`end_tag_closes`).
"""

from __future__ import annotations

from radiance.server.tool_parsers.base import ParseDelta, ParsedToolCall, ToolParser
from radiance.server.tool_parsers.glm45 import Glm45ToolParser
from radiance.server.tool_parsers.harmony import HarmonyToolParser
from radiance.server.tool_parsers.json_calls import HermesToolParser, Llama3JsonToolParser
from radiance.server.tool_parsers.mistral import MistralToolParser
from radiance.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
    Glm45ToolParser.name: Glm45ToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
    HarmonyToolParser.name: HarmonyToolParser,
}


def parse_tool_calls(parser: ToolParser, text: str, truncated: bool = False) -> ParseDelta:
    """Non-streaming: the whole text through the same scanner streaming uses."""
    out = parser.feed(text)
    out += parser.finish(truncated)
    return out


__all__ = ["PARSERS", "Glm45ToolParser", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParseDelta", "ParsedToolCall", "Qwen3CoderToolParser", "ToolParser", "parse_tool_calls"]
