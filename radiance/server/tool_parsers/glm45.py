"""GLM-4.5's calls (zai-org's chat template): `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...
</tool_call>` (GLM-4.7's without the newlines), the values text the tool's JSON schema types (a template writes
non-string values as JSON)."""

from __future__ import annotations

import json
import re

from radiance.server.tool_parsers.base import ParsedToolCall, ToolParser
from radiance.server.tool_parsers.qwen3_coder import _convert


class Glm45ToolParser(ToolParser):
    name = "glm45"
    _KEY = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
    _VALUE_END = "</arg_value>"

    def parse_call(self, body: str, cut: bool) -> ParsedToolCall | None:
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name or not self.offers(name):
            return None
        schema = ((self.tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args: dict = {}
        pos = 0
        while (key := self._KEY.search(body, pos)) is not None:
            end = body.find(self._VALUE_END, key.end())
            if end < 0:
                if cut:
                    break  # value cut off by max_tokens: keep only whole arguments
                return None  # a value the model never closed: no call
            args[key.group(1).strip()] = _convert(body[key.end():end], schema.get(key.group(1).strip()))
            pos = end + len(self._VALUE_END)
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except RecursionError:  # a value read nested deeper than json writes it: no call
            return None
        return ParsedToolCall(name, arguments, not cut or self.stopped_call_whole(body))

    def end_tag_closes(self, body: str) -> bool:
        """A </tool_call> inside an open value (code that writes the markup) does not end the call."""
        return body.count("<arg_value>") <= body.count(self._VALUE_END)

    def stopped_call_whole(self, body: str) -> bool:
        """A call the model stopped in is whole when every value it opened closed and no key follows the last
        (a call without arguments is its name alone): a value cut short is no call its client can trust."""
        last = body.rfind(self._VALUE_END)
        tail = body[last + len(self._VALUE_END):] if last >= 0 else body
        return body.count("<arg_value>") == body.count(self._VALUE_END) and "<arg_key>" not in tail
