"""One chat choice's stream: its cumulative engine outputs turned into deltas of content, reasoning and tool calls
(the reasoning parser first, then the tool-call parser, fed each new piece of text), with their logprobs. Chat
completions and the Responses API both run it; a non-streamed answer is the sum of its deltas."""

from __future__ import annotations

from typing import Any

from radiance.server.logprobs_json import LogprobCursor, chat_logprobs
from radiance.server.reasoning_parser import MESSAGE_SEPARATOR, PARSERS as REASONING_PARSERS, FunctionMessage
from radiance.server.state import ServerState
from radiance.server.tool_parsers import PARSERS as TOOL_PARSERS, ParseDelta


class ChoiceStream:
    """Turns one choice's cumulative engine outputs into deltas: content, reasoning, tool calls."""

    def __init__(self, state: ServerState, index: int, tools: list[dict] | None, opens_thinking: bool,
                 forced_prefix: str = "", named_tool: bool = False, token_ids_as_names: bool = False,
                 parallel_tool_calls: bool = True, include_reasoning: bool = True, skip_special_tokens: bool = True):
        self.index = index
        self.include_reasoning = include_reasoning  # vLLM's: false drops the reasoning (still parsed out)
        # false: one call at most, as OpenAI answers (strict tools' grammar ends the answer after it; a model writing
        # free markup may go on: its further calls are dropped)
        self.parallel_tool_calls = parallel_tool_calls
        self.token_ids_as_names = token_ids_as_names  # vLLM's return_tokens_as_token_ids
        # tool_choice named one function: OpenAI (and vLLM) finish such a call with "stop", not "tool_calls"
        self.named_tool = named_tool
        self.tokenizer = state.tokenizer
        # a forced harmony call's header is the harmony reasoning parser's to read (it hands calls on)
        harmony_forced = bool(forced_prefix) and state.reasoning_parser_name == "harmony"
        self.reasoning = (REASONING_PARSERS[state.reasoning_parser_name](opens_thinking)
                          if state.reasoning_parser_name and (not forced_prefix or harmony_forced) else None)
        self.tools = TOOL_PARSERS[state.tool_parser_name](tools) if tools and state.tool_parser_name else None
        if forced_prefix:  # the call markup we put at the end of the prompt is part of what we parse
            (self.reasoning if harmony_forced else self.tools).feed(forced_prefix)
        self.sent_chars = 0
        # the text keeps the special tokens a parser reads (needs_special_tokens): they count there
        self.logprob_cursor = LogprobCursor(state.tokenizer, skip_special_tokens and not self.needs_special_tokens)
        self.num_tool_calls = 0
        self.cut_call_ids: set[str] = set()  # calls max_tokens cut off before their arguments were whole
        self.content_sent = False
        self.separate_next = False  # the next content follows a harmony function message's body made text
        self.output: Any = None

    @property
    def hides_logprobs(self) -> bool:
        """include_reasoning false: the tokens' logprobs name the reasoning's tokens, so none go out (vLLM's rule,
        streamed or not: the answer's logprobs are null), as the reasoning itself does not."""
        return self.reasoning is not None and not self.include_reasoning

    @property
    def needs_special_tokens(self) -> bool:
        """Its reasoning or tool parser reads markers that are special tokens (harmony, Mistral's [TOOL_CALLS]),
        which the text must keep; the parser takes them out again."""
        return any(parser is not None and parser.needs_special_tokens for parser in (self.reasoning, self.tools))

    def _route(self, text: str, delta: dict) -> None:
        if not text:
            return
        if self.separate_next:
            text, self.separate_next = MESSAGE_SEPARATOR + text, False
        if self.tools is None:
            delta["content"] = delta.get("content", "") + text
            self.content_sent = True
            return
        parsed = self.tools.feed(text)
        self._take(parsed, delta)

    def _route_function_message(self, message: FunctionMessage, delta: dict, truncated: bool) -> None:
        """A harmony call: the tool parser's to make a call of; without tools in the request its body is text.
        `truncated`: max_tokens ended the output (inside the message when it is incomplete)."""
        parsed = (ParseDelta(content=message.arguments) if self.tools is None
                  else self.tools.function_message(message, truncated))
        if parsed.content:  # one more message of the content: set apart from its neighbours, as they are
            parsed.content = (MESSAGE_SEPARATOR if self.content_sent else "") + parsed.content
            self.separate_next = not message.content_before  # else the reasoning parser sets the next one apart
        self._take(parsed, delta)

    def _take(self, parsed, delta: dict) -> None:
        if parsed.content:
            delta["content"] = delta.get("content", "") + parsed.content
            self.content_sent = True
        for call in parsed.tool_calls:
            if self.num_tool_calls and not self.parallel_tool_calls:
                continue
            call_id = self.tools.new_call_id()
            delta.setdefault("tool_calls", []).append({
                "index": self.num_tool_calls, "id": call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}})
            self.num_tool_calls += 1
            if not call.complete:
                self.cut_call_ids.add(call_id)

    def step(self, out: Any) -> tuple[dict, dict | None]:
        """(delta, logprobs or None) for the text this output adds; flushes the parsers when finished."""
        self.output = out
        new_text = out.text[self.sent_chars:]
        self.sent_chars = len(out.text)
        delta: dict = {}
        truncated = out.finished and out.finish_reason == "length"
        if self.reasoning is None:
            self._route(new_text, delta)
        else:
            r = self.reasoning.feed(new_text)
            if out.finished:
                r.extend(self.reasoning.finish())
            if r.reasoning and self.include_reasoning:
                delta["reasoning_content"] = r.reasoning
                delta["reasoning"] = r.reasoning
            start = 0
            for message in r.function_messages:  # each in its place among the content, in any chunking
                self._route(r.content[start:message.at], delta)
                start = message.at
                self._route_function_message(message, delta, truncated)
            self._route(r.content[start:], delta)
        if out.finished:
            if self.tools is not None:
                self._take(self.tools.finish(truncated=truncated), delta)
        released = None if self.hides_logprobs else self.logprob_cursor.release(out, self.sent_chars)
        logprobs = None if released is None else chat_logprobs(self.tokenizer, released[0], self.token_ids_as_names,
                                                                released[1])
        return delta, logprobs

    def finish_reason(self) -> str | None:
        reason = self.output.finish_reason if self.output is not None else None
        return "tool_calls" if reason == "stop" and self.num_tool_calls and not self.named_tool else reason

    def stop_reason(self) -> int | str | None:
        return self.output.stop_reason if self.output is not None else None
