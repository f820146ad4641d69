"""The parts of OpenAI's chat requests that describe a conversation: messages (text content parts, tool calls, the
deprecated function role read as tools) and the tools offered; and the strict pydantic base every request model
of the API uses (protocol.py, protocol_responses.py, protocol_tokenizer.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

_STRICT = ConfigDict(extra="ignore", strict=True)


class _Model(BaseModel):
    model_config = _STRICT
    # fields whose explicit null means something of its own, not the default (see _null_is_default)
    null_is_not_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's API documents its optional fields as nullable ("n": null means n = 1) and some clients
        send the nulls: a null where the default is not None gives the default. A required field stays required;
        a field of `null_is_not_default` keeps its null."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].default is None or fields[key].is_required()
                or key in cls.null_is_not_default}


# OpenAI's reasoning efforts ("xhigh" its newest) and vLLM's "max" (DeepSeek V4's), as vLLM takes them: chat's
# reasoning_effort and the Responses API's reasoning.effort
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


def named_form_checked(model: type[BaseModel], form: str) -> BeforeValidator:
    """A tool_choice object read as the named form `model` (`form` its JSON shape, for the message), its own error
    telling what is wrong with it ("function.name is missing"), where the union's first error said the value
    should be 'none', 'auto' or 'required'."""

    def check(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in error["loc"])
            fault = f"{where} is missing" if error["type"] == "missing" else f"{where}: {error['msg']}"
            raise ValueError(f"tool_choice as an object names a function, {form}: {fault}") from None

    return BeforeValidator(check)


# chat's tool_choice (and /tokenize's): a string choice, or a function named
ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                       named_form_checked(NamedToolChoice, '{"type": "function", "function": {"name": ...}}')]


class FunctionCall(_Model):
    name: str
    arguments: str

    @field_validator("arguments", mode="before")
    @classmethod
    def _object_as_json(cls, value: Any) -> Any:
        """OpenAI's arguments are a JSON string; a client that sends back the object it parsed is read as that
        JSON (templates get the object either way), not refused."""
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# content part types that carry text under another name -> the field holding it (vLLM's chat_utils reads them as text)
_TEXT_LIKE_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


class ContentPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    # "function": OpenAI's deprecated function calling (a function's result, named by `name`), read as a tool message
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # the deprecated API's one call of an assistant turn: read as tool_calls
    reasoning_content: str | None = None  # an earlier turn's reasoning sent back (vLLM's field; ours too)
    reasoning: str | None = None  # the same, as other servers name it (we send both)
    thinking: str | None = None  # the same, as gpt-oss's chat template reads it (harmony clients send it so)

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """Parts that are text under another type are read as text parts, as vLLM reads them: the Responses API's
        `input_text` / `output_text` (their `text`) and an assistant's `refusal` (its `refusal`). An image or audio
        part is refused by name (the union with str reported "Input should be a valid string", which told the
        client nothing)."""
        parts = data.get("content") if isinstance(data, dict) else None
        if not isinstance(parts, list):
            return data
        read = []
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and not isinstance(kind, str):
                raise ValueError(f"a content part's type must be a string, got {kind!r}")
            if kind in _TEXT_LIKE_PARTS:
                part = {"type": "text", "text": part.get(_TEXT_LIKE_PARTS[kind])}
            elif kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text only "
                                 f"(a string, or parts of type 'text', 'input_text', 'output_text' or 'refusal')")
            read.append(part)
        return {**data, "content": read}

    @field_validator("tool_calls")
    @classmethod
    def _no_calls_is_none(cls, calls: list[ToolCall] | None) -> list[ToolCall] | None:
        """An empty list is no calls (vLLM drops it too): templates that test `'tool_calls' in message` (Llama 3.1's,
        gpt-oss's) took a text answer sent back with `tool_calls: []` (older vLLM's answer shape, what an SDK's dump
        of one gives) for a call turn, and refused it ("only supports single tool-calls") or dropped its content."""
        return calls or None

    # set by _legacy_function_calling: the message was a function message / an assistant's function_call
    _function_result: bool = PrivateAttr(False)
    _function_call: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _legacy_function_calling(self):
        """OpenAI's deprecated function calling in tool-calling terms, as chat templates know only those: a `function`
        message is a `tool` message (its `name` kept, and required as OpenAI does; a null content: ""), an
        assistant's `function_call` its one tool call (a 400 on another role or beside tool_calls). vLLM hands the
        template role "function" as sent (Qwen's templates drop such a message, Llama 3's print a "function"
        header) and drops function_call. pair_function_calls gives a call and its result one id."""
        if self.role == "function":
            if not self.name:  # OpenAI's 400 too: the name is what says which function answered
                raise ValueError("a function message needs the name of the function it answers")
            self.role, self._function_result = "tool", True
            if self.content is None:
                self.content = ""
        if self.function_call is not None:
            if self.role != "assistant" or self.tool_calls:
                raise ValueError("function_call is an assistant message's field, and not one beside tool_calls")
            self.tool_calls, self._function_call = [ToolCall(function=self.function_call)], True
            self.function_call = None
        return self

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str | None:
        """The content as one text: parts joined by newlines, as vLLM joins them (one part: its text)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


def pair_function_calls(messages: list[ChatMessage]) -> None:
    """The deprecated API's calls and results carry no ids; templates that match a result to its call by id (Mistral's,
    gpt-oss's) need them: an assistant's function_call gets `call_fn<its message index>`, and the function message
    after it that answers it (its name, or none) that id as tool_call_id. Idempotent (a message keeps an id it has)."""
    pending: tuple[str, str] | None = None  # the latest call not yet answered: (its function's name, its id)
    for index, message in enumerate(messages):
        if message._function_call and message.tool_calls[0].id is None:
            message.tool_calls[0].id = f"call_fn{index}"
        if message._function_call:
            pending = (message.tool_calls[0].function.name, message.tool_calls[0].id)
        elif message._function_result and pending is not None and message.name in (None, pending[0]):
            if message.tool_call_id is None:
                message.tool_call_id = pending[1]
            pending = None
