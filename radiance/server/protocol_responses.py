"""The request of OpenAI's Responses API (`POST /v1/responses`) and its translation into a chat request.

A Responses request is a chat request in other words: `instructions` is the system message, `input` a
string or a list of items (messages, function calls and their outputs, reasoning), `text.format` the
response_format, `max_output_tokens` the output budget, function tools are flat. `to_chat` builds the
ChatCompletionRequest that the chat route would serve, so both APIs share one pipeline. Only what a
text-only model can serve is accepted: images, files and built-in tools (web search, ...) are 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from radiance.server.protocol import ChatCompletionRequest, TemplateKwargs, _Request, _SamplingFields
from radiance.server.protocol_messages import ReasoningEffort, _Model, named_form_checked

INPUT_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values OpenAI defines (ResponseIncludable) that this server accepts: the logprobs it serves, and
# reasoning.encrypted_content, which exists so reasoning items can be sent back statelessly (store false); ours
# carry their thinking in the clear (`content`), which input_messages reads back, so ignoring it loses nothing
# (and Codex CLI sends it with every stateless request)
ACCEPTED_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
# the other values OpenAI defines: each adds the output of something a text-only server without built-in tools
# never produces, so asking for one is a 400 rather than a silent no-op
INAPPLICABLE_INCLUDES = {
    "file_search_call.results": "file_search tool", "web_search_call.results": "web_search tool",
    "web_search_call.action.sources": "web_search tool",
    "code_interpreter_call.outputs": "code_interpreter tool",
    "computer_call_output.output.image_url": "computer tool", "message.input_image.image_url": "image input",
}
# the chat request's sampling fields beyond OpenAI's Responses fields, passed on as they are
CHAT_SAMPLING_FIELDS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "logit_bias", "min_tokens", "include_stop_str_in_output", "ignore_eos",
                        "skip_special_tokens", "bad_words", "allowed_token_ids", "cache_salt")


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, not used


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Model):
    effort: ReasoningEffort | None = None  # chat's reasoning_effort
    summary: str | None = None  # accepted and echoed: thinking comes back whole, as a reasoning item


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionToolChoice | None,
                           named_form_checked(FunctionToolChoice, '{"type": "function", "name": ...}')] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: TemplateKwargs = None  # as on chat (e.g. enable_thinking for Qwen3)
    background: bool = False
    conversation: str | dict[str, Any] | None = None  # OpenAI's stored conversations: not kept here (a 400)
    # sampling fields the chat route takes beyond OpenAI's (vLLM accepts them on /v1/responses too), declared
    # as protocol._SamplingFields declares them
    top_k: int | None = Field(None, ge=-1, lt=2**63)  # the sampler holds it in an int64 tensor
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    cache_salt: str | None = Field(None, min_length=1)

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversations(cls, value):
        if value is not None:  # was ignored: the answer came without the conversation's earlier turns
            raise ValueError("conversations are not kept by this server; chain responses with previous_response_id "
                             "(or send the earlier items in input)")
        return value

    @field_validator("include")
    @classmethod
    def _known_includes(cls, values):
        check_includes(values or ())
        return values

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input is empty")
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools):
        for i, tool in enumerate(tools or ()):
            if tool.get("type") != "function":
                raise ValueError(f"only function tools are supported, tools[{i}] has type {tool.get('type')!r}")
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ValueError(f"tools[{i}].{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        return tools

    @model_validator(mode="after")
    def _sampling_as_on_chat(self):
        """The chat request's own checks of these fields (stop strings non-empty, logit_bias keys and values),
        here so that a bad value is refused naming its field, not as a fault of the chat request built later."""
        if self.max_output_tokens is not None and self.min_tokens > self.max_output_tokens:
            raise ValueError(f"min_tokens must be at most max_output_tokens, got min_tokens {self.min_tokens} > "
                             f"max_output_tokens {self.max_output_tokens}")
        try:
            _SamplingFields.model_validate(self.chat_sampling_fields())
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return self

    def chat_sampling_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in CHAT_SAMPLING_FIELDS if getattr(self, name) is not None}

    def tool_choice_error(self) -> str | None:
        """Why tool_choice does not fit the tools (None when it does)."""
        if isinstance(self.tool_choice, FunctionToolChoice):
            names = [t.name for t in self.function_tools()]
            if self.tool_choice.name not in names:
                return (f"tool_choice names function {self.tool_choice.name!r}, which is not among the tools "
                        f"({', '.join(names) or 'none given'})")
        elif self.tool_choice == "required" and not self.tools:
            return "tool_choice required needs tools"
        return None

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or ()]

    def wants_logprobs(self) -> bool:
        """Logprobs come back only with include ["message.output_text.logprobs"], as OpenAI's and vLLM's:
        top_logprobs alone sets how many alternatives they would carry, and the output's logprobs stay []."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_chat(self, history: list[dict], dropped_units: int = 0) -> ChatCompletionRequest:
        """The chat request that serves this one: instructions, then `history` (the conversation of
        previous_response_id), then the input, less the `dropped_units` oldest conversation_units (truncation).
        ValueError (a 400 on `input`) for items it cannot serve."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else [])
        conversation = history + input_messages(self.input)
        _check_call_outputs(conversation)
        units = conversation_units(conversation)
        messages += [message for unit in units[dropped_units:] for message in unit]
        if not messages:
            raise ValueError("input has no message to answer (only reasoning items)")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, **self.chat_sampling_fields(),
            "user": self.user, "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "logprobs": self.wants_logprobs(), "top_logprobs": self.top_logprobs if self.wants_logprobs() else None,
        }
        if self.tools:  # a Responses function is strict unless it says otherwise (OpenAI's default here)
            body["tools"] = [{"type": "function", "function": {**t.model_dump(exclude_none=True, exclude={"type"}),
                                                               "strict": t.strict is not False}}
                             for t in self.function_tools()]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None and self.tools:  # OpenAI takes "auto" / "none" without tools; chat not
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}}
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def check_includes(values) -> None:
    """ValueError naming the first `include` value this server does not serve."""
    for value in values:
        if value in INAPPLICABLE_INCLUDES:
            raise ValueError(f"include value {value!r} cannot apply here: this server has no "
                             f"{INAPPLICABLE_INCLUDES[value]} (text-only, function tools only)")
        if value not in ACCEPTED_INCLUDES:
            raise ValueError(f"include value {value!r} is unknown; the values are "
                             f"{', '.join(ACCEPTED_INCLUDES + tuple(INAPPLICABLE_INCLUDES))}")


def conversation_units(messages: list[dict]) -> list[list[dict]]:
    """`messages` in the pieces truncation drops whole: each message, with the tool messages after it (a
    function call's outputs go with the call: a template may refuse an output whose call is gone)."""
    units: list[list[dict]] = []
    for message in messages:
        if message["role"] == "tool" and units:
            units[-1].append(message)
        else:
            units.append([message])
    return units


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_input_items(items: str | list[dict[str, Any]], new_id: Callable[[str], str]) -> list[dict]:
    """`input` as GET /v1/responses/{id}/input_items lists it: typed items with an id (the client's, else
    `new_id(prefix)`: pages are cut after an id), a message's string content as one text part."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        item = {"type": "message", **item} if "type" not in item else dict(item)
        if not isinstance(item.get("id"), str):
            item["id"] = new_id(_ITEM_ID_PREFIXES.get(item["type"], "item"))
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                text = item["content"]
                item["content"] = [{"type": "output_text", "text": text, "annotations": []}
                                   if item.get("role") == "assistant" else {"type": "input_text", "text": text}]
        listed.append(item)
    return listed


def _text(content: Any, where: str) -> str:
    """The text of a message's content (`where` names it): a string, or parts of type input_text /
    output_text / refusal."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list there is unhashable: it raised a TypeError (500)
        key = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}.get(kind)
        if key is None:
            if kind in ("input_image", "input_file", "input_audio"):
                raise ValueError(f"{where}[{j}] is {kind}; this server serves text-only models")
            raise ValueError(f"{where}[{j}] has unsupported type {kind!r}")
        if not isinstance(part.get(key), str):
            raise ValueError(f"{where}[{j}] needs a string {key}")
        texts.append(part[key])
    return "\n".join(texts)  # as chat joins its text parts (vLLM)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{where} ({item.get('type')}) needs a string {name}")
    return value


def _reasoning_text(item: dict, where: str) -> str | None:
    """A reasoning item's thinking: its content (our reasoning items carry it whole), else its summary (OpenAI's
    carry only that), else None (only encrypted_content, which this server cannot read)."""
    texts = {}
    for name in ("content", "summary"):
        parts = item.get(name) or []
        if not isinstance(parts, list):
            raise ValueError(f"{where}.{name} must be a list of parts")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.{name}[{j}] needs a string text")
        texts[name] = "".join(part["text"] for part in parts)
    return texts["content"] or texts["summary"] or None


def _check_call_outputs(messages: list[dict]) -> None:
    """Each function_call_output answers a call made before it (in this input or the previous responses), as OpenAI
    requires: an unknown call_id was served as a tool message answering nothing."""
    calls: set[str] = set()
    for message in messages:
        calls.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in calls:
            raise ValueError(f"no function call found for the function_call_output with call_id "
                             f"{message['tool_call_id']!r}")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Chat messages for a Responses `input`: messages keep their role (system / developer / user /
    assistant); function calls join the assistant message before them (or start one); function-call
    outputs become tool messages; a reasoning item goes with the assistant message after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ValueError(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}")
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise ValueError(f"{where}: item_reference is not supported; send the item itself or use "
                             "previous_response_id")
        else:
            raise ValueError(f"{where} has unsupported type {kind!r}")
    return messages
