"""`/v1/responses` (OpenAI's Responses API) on the chat pipeline: the request becomes a chat request
(protocol_responses), the chat parsers' deltas become output items (reasoning, message, function_call)
in the order they start, streamed as typed events (`response.created` ... `response.completed`).

Streaming and non-streaming build the same items with the same `OutputItems`, so both agree. A stream that
fails after it started ends with `response.failed` (the response, its `error` set); one its client left is
stored `cancelled`. Stored responses (in memory, `ServerConfig.responses_store`) serve previous_response_id,
GET / DELETE and GET .../input_items.
"""

from __future__ import annotations

import copy
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from radiance.engine.sampling_params import SamplingParamsError
from radiance.server.errors import JSONAnswer, OpenAIError, field_named_first, invalid, json_text
from radiance.server.protocol_responses import (ReasoningConfig, ResponsesRequest, check_includes, conversation_units,
                                                input_messages, listed_input_items)
from radiance.server.response_store import StoredResponse
from radiance.server.chat_choice import ChoiceStream
from radiance.server.serving_chat import prepare_chat
from radiance.server.logprobs_json import token_chars
from radiance.server.serving_common import check_unicode, collect_until_disconnect, guarded_sse, merged_outputs
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)


def item_id(prefix: str) -> str:
    """OpenAI's id style for responses and their items: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# chat request fields (and the engine's max_tokens) -> the Responses fields they came from (for error messages)
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
                "response_format": "text.format"}
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_CONTEXT_EXCEEDED = "context_length_exceeded"  # the code of the 400 for a prompt too long for the context


_CHAT_FIELD = re.compile(r"\b(" + "|".join(map(re.escape, _FIELD_NAMES)) + r")\b")  # whole words only


def _responses_names(message: str) -> str:
    """A chat-completions error message in this API's field names ("messages[0]" -> "input[0]"); whole words
    only, so a quoted value that contains a field's name ("max_tokens_x") keeps it."""
    return _CHAT_FIELD.sub(lambda m: _FIELD_NAMES[m[1]], message)


class OutputItems:
    """Chat deltas -> Responses output items, each opened when its first piece comes and closed when
    another kind starts (or at the end), with the streaming events that say so."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the text item (message or reasoning) still growing
        self._logprobs: list[dict] = []  # token logprobs not yet sent with a text delta (or dropped)

    def feed(self, delta: dict, logprobs: dict | None, cut_call_ids: set[str] = frozenset()) -> list[dict]:
        """Items for a chat delta; a call whose id is in cut_call_ids ends "incomplete" (cut by max tokens)."""
        events: list[dict] = []
        if logprobs is not None:
            self._logprobs += logprobs["content"]
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            status = "incomplete" if call["id"] in cut_call_ids else "completed"
            events += self._close("completed") + self._call(call, status)
        return events

    def finish(self, complete: bool) -> list[dict]:
        """Closes what is open; a truncated answer leaves its last item incomplete."""
        return self._close("completed" if complete else "incomplete")

    def text(self, kind: str) -> str:
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == kind)

    def _index(self, item: dict) -> int:
        return self.items.index(item)

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._start(kind)
        item = self._open
        part = item["content"][0]
        part["text"] += text
        event = {"type": f"{_TEXT_EVENTS[kind]}.delta", "item_id": item["id"], "output_index": self._index(item),
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = self._logprobs_of(text)
            part.setdefault("logprobs", []).extend(event["logprobs"])
        return events + [event]

    def _logprobs_of(self, text: str) -> list[dict]:
        """The logprobs of the tokens that make `text`, the message's newest text: the waiting ones at the end
        whose characters cover it. Those before them made reasoning, a call or markup (`</think>`) and are
        dropped: a message's logprobs spell its own text, as OpenAI's do."""
        taken, chars = [], 0
        while self._logprobs and chars < len(text):
            taken.append(self._logprobs.pop())
            chars += token_chars(taken[-1]["token"])
        self._logprobs = []
        return taken[::-1]

    def _start(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        events = [{"type": "response.output_item.added", "output_index": self._index(item), "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": self._index(item),
                   "content_index": 0, "part": copy.deepcopy(part)}]
        item["content"].append(part)
        self._open = item
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        done = {"type": f"{_TEXT_EVENTS[item['type']]}.done", **where, "text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = part.setdefault("logprobs", [])
        item["status"] = status
        return [done, {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": self._index(item), "item": copy.deepcopy(item)}]

    def _call(self, call: dict, status: str) -> list[dict]:
        fn = call["function"]
        item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": fn["name"], "arguments": ""}
        self.items.append(item)
        index = self._index(item)
        events = [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)},
                  {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                   "delta": fn["arguments"]}]
        item["arguments"], item["status"] = fn["arguments"], status
        return events + [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                          "name": fn["name"], "arguments": fn["arguments"]},
                         {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


def _text_logprobs(logprobs: dict, released: list, textless: frozenset[int]) -> dict:
    """The chat logprobs of `released` (the engine's entries they were made of, in order) less those of the
    tokens the text leaves out (EOS let through by ignore_eos, with skip_special_tokens): such a token makes no
    text, so it has no place in a message's logprobs, and OutputItems, which counts a token by its own text
    ("<eos>": 5 characters), would let it stand for text that other tokens made."""
    kept = [entry for entry, engine_entry in zip(logprobs["content"], released)
            if engine_entry.token_id not in textless]
    return {**logprobs, "content": kept}


def _answer_message(items: OutputItems) -> dict:
    """The model's turn as the chat message a follow-up (previous_response_id) renders."""
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items.items if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": items.text("message") or (None if calls else "")}
    if items.text("reasoning"):
        message["reasoning_content"] = items.text("reasoning")
    if calls:
        message["tool_calls"] = calls
    return message


class ResponseRun:
    """One /v1/responses request from its parsed body to its response object (and its stored copy)."""

    def __init__(self, state: ServerState, req: ResponsesRequest, model: str):
        self.state, self.req, self.model = state, req, model
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.choice: ChoiceStream | None = None
        self.prompt_len = 0
        self.previous: StoredResponse | None = None  # the stored response previous_response_id names
        self.history: list[dict] = []
        self.stored: StoredResponse | None = None  # what this run last put in the store (None: nothing yet)
        self.input_items: list[dict] | None = None  # what its stored copies list as input items, with their ids
        self.finalized = False  # its final body (completed, incomplete or failed) is made

    async def prepare(self):
        """The engine job, or a 400 naming the field at fault."""
        req = self.req
        if req.tool_choice_error():
            raise invalid(req.tool_choice_error(), param="tool_choice")
        if req.instructions:  # checked here, or the rendered prompt's check blames `input`
            check_unicode(req.instructions, "instructions")
        if req.previous_response_id is not None:
            self.previous = self.state.responses.get(req.previous_response_id)
            if self.previous is None:
                # OpenAI's code, which clients (Codex CLI) read to send the whole conversation instead
                raise invalid(f"no stored response has id {req.previous_response_id!r} (this server keeps "
                              f"{self.state.responses.limits()} in memory)", param="previous_response_id",
                              code="previous_response_not_found")
            if self.previous.in_progress:  # its answer is not there yet to continue from
                raise invalid(f"previous response {req.previous_response_id!r} is still in progress: wait for it "
                              "to complete", param="previous_response_id")
            self.history = self.previous.conversation
        prepared = await (self._prepare_truncated() if req.truncation == "auto" else self._prepare_chat())
        self.choice = prepared.choices[0]
        self.prompt_len = len(prepared.prompt_ids)
        return prepared

    async def _prepare_chat(self, dropped_units: int = 0):
        """The chat pipeline's preparation of this request, less its `dropped_units` oldest conversation units."""
        try:
            chat = self.req.to_chat(self.history, dropped_units)
        except ValidationError as exc:  # a message the chat request refuses (e.g. a user turn without content)
            err = exc.errors()[0]
            where = ".".join(str(part) for part in err["loc"])
            raise invalid(f"input: {err['msg']} (as the chat request's {where})", param="input") from None
        except ValueError as exc:
            raise invalid(str(exc), param="input") from None
        try:
            return await prepare_chat(self.state, chat, self.id)
        except OpenAIError as exc:  # named as this API names the field
            exc.message = _responses_names(exc.message)
            exc.param = _FIELD_NAMES.get(exc.param, exc.param)
            raise
        except SamplingParamsError as exc:  # e.g. min_tokens over the room the context leaves for output
            message = _responses_names(str(exc))
            raise invalid(message, param=field_named_first(message, ResponsesRequest)) from None

    async def _prepare_truncated(self):
        """truncation "auto" (OpenAI's): when the prompt and max_output_tokens overflow the context, the oldest
        conversation units are dropped, the fewest that make it fit (bisection: each try renders and tokenizes
        the whole prompt). The instructions and the newest unit stay; without room even then, the 400 says so."""
        try:
            return await self._prepare_chat()
        except OpenAIError as exc:
            if exc.code != _CONTEXT_EXCEEDED:
                raise
            too_long = exc
        droppable = len(conversation_units(self.history + input_messages(self.req.input))) - 1
        low, high, fitting = 1, droppable, None
        while low <= high:  # fitting: the last try that fit, the one with the fewest units dropped
            middle = (low + high) // 2
            try:
                fitting, high = await self._prepare_chat(middle), middle - 1
            except OpenAIError as exc:
                if exc.code != _CONTEXT_EXCEEDED:
                    raise
                too_long, low = exc, middle + 1
        if fitting is None:
            too_long.message += " (truncation auto kept only the instructions and the newest input item)"
            raise too_long
        return fitting

    def step(self, out: Any) -> list[dict]:
        cursor = self.choice.logprob_cursor
        sent = cursor.sent
        delta, logprobs = self.choice.step(out)
        if logprobs is not None:
            logprobs = _text_logprobs(logprobs, out.logprobs[sent:cursor.sent], cursor.textless)
        events = self.items.feed(delta, logprobs, self.choice.cut_call_ids)
        if out.finished:
            events += self.items.finish(complete=out.finish_reason != "length")
        return events

    def body(self, status: str, error: dict | None = None) -> dict:
        req, out = self.req, self.choice.output if self.choice else None
        finished = status != "in_progress"
        truncated = finished and out is not None and out.finish_reason == "length"
        output_tokens = len(out.token_ids) if out is not None else 0
        reasoning = self.items.text("reasoning")
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if truncated else status, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": copy.deepcopy(self.items.items) if finished else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": (req.reasoning or ReasoningConfig()).model_dump(), "store": self._stores(),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "user": req.user, "metadata": req.metadata or {},
            "usage": None if not finished else {
                "input_tokens": self.prompt_len,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens if out is not None else 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(output_tokens, len(self.state.tokenizer.encode(
                    reasoning, add_special_tokens=False))) if reasoning else 0},
                "total_tokens": self.prompt_len + output_tokens},
        }

    def _stores(self) -> bool:
        return self.req.store and self.state.responses.enabled

    def store(self, body: dict) -> None:
        """Stores `body` (store true): an in-progress one while a stream runs (GET reads it as OpenAI's does), then
        the final one in its place; a response DELETE removed meanwhile stays deleted."""
        if body["status"] != "in_progress":
            self.finalized = True
        if not self._stores() or (self.stored is not None and self.stored.deleted):
            return
        # instructions do not carry over to a follow-up (OpenAI's rule)
        conversation = self.history + input_messages(self.req.input) + [_answer_message(self.items)]
        if self.input_items is None:  # listed once: each listing gives the items new ids (in progress, then final)
            self.input_items = self._input_items()
        self.stored = StoredResponse(body, conversation, self.input_items)
        previous_id = self.req.previous_response_id if self.previous is not None else None
        if not self.state.responses.put(self.id, self.stored, previous_id) and self.finalized:  # told once
            logger.warning("response %s not stored: larger than --responses-store-bytes %d by itself", self.id,
                           self.state.responses.max_bytes)

    def _input_items(self) -> list[dict]:
        """What input_items lists: the context previous_response_id brought (its input items and output), then
        this request's input; instructions are no item (OpenAI's rule)."""
        context = self.previous.input_items + self.previous.body["output"] if self.previous is not None else []
        return context + listed_input_items(self.req.input, item_id)

    def cancel(self, exc: OpenAIError) -> list[dict]:
        """The events that end a stream cut short (the client left, or the server shuts down): stored as
        `cancelled` (what a later GET can see: only a client that left leaves a server to ask), told in-band as a
        failure with `exc` (what a client still listening to a server going down reads)."""
        events = self.items.finish(complete=False)
        body = self.body("cancelled")
        self.store(body)
        return events + [{"type": "response.failed", "response": {**body, "status": "failed",
                                                                  "error": _response_error(exc)}}]

    def fail(self, exc: OpenAIError) -> list[dict]:
        """The events that end a stream failing after it started: the item still open closes incomplete, then
        `response.failed` carries the response with its error (as stored: a GET reads it back as failed)."""
        events = self.items.finish(complete=False)
        body = self.body("failed", error=_response_error(exc))
        self.store(body)
        return events + [{"type": "response.failed", "response": body}]


def _response_error(exc: OpenAIError) -> dict:
    """A failed response's `error`, with the code of OpenAI's list that fits: the engine refused the request
    (a 4xx), or the server failed."""
    return {"code": "invalid_prompt" if exc.status < 500 else "server_error", "message": exc.message}


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    engine = state.require_engine()
    model = state.check_model(req.model)
    lora_request = state.lora_request(model)  # read with the name, before any await: an unload cannot come between
    run = ResponseRun(state, req, model)
    prepared = await run.prepare()
    outputs = merged_outputs(engine, prepared.jobs, state.metrics, lora_request=lora_request)
    if req.stream:
        return StreamingResponse(_stream(run, outputs), media_type="text/event-stream")
    await collect_until_disconnect(request, outputs, lambda _index, out: run.step(out))
    body = run.body("completed")
    run.store(body)
    return JSONAnswer(body)


def _stream(run: ResponseRun, outputs: AsyncIterator) -> AsyncIterator[str]:
    counter = iter(range(1 << 62))

    def event(body: dict) -> str:
        body = {**body, "sequence_number": next(counter)}
        return f"event: {body['type']}\ndata: {json_text(body)}\n\n"

    def failed_events(exc: OpenAIError) -> str:  # a stream that started ends as a response: response.failed
        return "".join(event(body) for body in run.fail(exc))

    def cancelled_events(exc: OpenAIError) -> str:
        return "".join(event(body) for body in run.cancel(exc))

    async def events() -> AsyncIterator[str]:
        created = run.body("in_progress")
        run.store(created)  # GET /v1/responses/{id} answers it, in_progress, while the stream runs
        try:
            yield event({"type": "response.created", "response": created})
            yield event({"type": "response.in_progress", "response": run.body("in_progress")})
            async for _index, out in outputs:
                for body in run.step(out):
                    yield event(body)
            final = run.body("completed")
            run.store(final)
            yield event({"type": f"response.{final['status']}", "response": final})
        finally:
            if not run.finalized:  # closed before its end (the client left) with nothing reported yet
                run.store(run.body("cancelled"))

    return guarded_sse(events(), outputs, f"responses stream {run.id}", error_event=failed_events, done=False,
                       cancelled_event=cancelled_events)


def stored_response(state: ServerState, response_id: str) -> dict:
    return _stored(state, response_id).body


def stored_input_items(state: ServerState, response_id: str, order: str, after: str | None, limit: int,
                       include: list[str]) -> dict:
    """GET /v1/responses/{id}/input_items: a page of the items its context was made of. `include` takes the
    values creating a response takes; none of them adds to input items here (a message keeps what it had)."""
    stored = _stored(state, response_id)
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order!r}", param="order")
    if not 1 <= limit <= 100:  # OpenAI's range
        raise invalid(f"limit must be between 1 and 100, got {limit}", param="limit")
    try:
        check_includes(include)
    except ValueError as exc:
        raise invalid(str(exc), param="include") from None
    page = stored.input_items_page(order, after, limit)
    if page is None:
        raise invalid(f"after: response {response_id!r} has no input item with id {after!r}", param="after")
    return page


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:  # OpenAI's (and vLLM's) 404 for a response it does not have: an invalid_request_error
        raise OpenAIError(404, f"Response with id {response_id!r} not found (this server keeps "
                          f"{state.responses.limits()} in memory).", param="response_id",
                          code="not_found", type="invalid_request_error")
    return stored
