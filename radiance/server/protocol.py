"""Request models of the OpenAI-compatible API (pydantic).

Requests are validated strictly (a string is not an integer, a bool is not a number) so a malformed
request fails with a 400 naming the field instead of being silently coerced. Unknown fields are
ignored, as OpenAI clients send some we do not use. Responses are plain dicts in OpenAI's shape (response_bodies).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from radiance.engine.request_checks import check_logit_bias_value
from radiance.server.protocol_messages import (ChatMessage, NamedToolChoice, ReasoningEffort, Tool, ToolChoice, _Model,
                                               pair_function_calls)
from radiance.engine.structured_output import StructuredOutput

logger = logging.getLogger(__name__)
class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type json_schema, and only then")
        return self


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's options: taken where the grammar already does what they ask, whitespace_pattern and structural_tag
    # refused by name (StructuredOutput's rules, as the offline API's)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        self.spec()
        return self

    def spec(self) -> StructuredOutput:
        return StructuredOutput(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                choice=self.choice, grammar=self.grammar,
                                disable_any_whitespace=bool(self.disable_any_whitespace),
                                disable_additional_properties=bool(self.disable_additional_properties),
                                disable_fallback=bool(self.disable_fallback),
                                whitespace_pattern=self.whitespace_pattern, structural_tag=self.structural_tag)


# vLLM's older request fields, each one constraint: the StructuredOutput field it gives
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class _Request(_Model):
    """A request body (chat, completions, responses): its top-level fields radiance does not know are ignored (as
    vLLM does; OpenAI would refuse them) and logged, so that an extension a client relies on (vLLM's `documents`,
    `mm_processor_kwargs`, ...) is not silently lost."""

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = sorted(str(key) for key in data if key not in cls.model_fields)
            if ignored:
                logger.warning("%s: ignored request fields %s (not supported)", cls.__name__, ", ".join(ignored))
        return data


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, lt=2**63)  # the sampler holds it in an int64 tensor
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # the range torch generators accept
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) ends the text
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: EOS and stop tokens / strings wait for this many tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # vLLM's extension; 1 = off. NaN / inf: "a finite number" naming the field (NaN failed "<= 2" before)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extension: each prompt token's logprob, rank and this many alternatives (not while streaming)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extension: logprobs name each token "token_id:N" (a part of a character, or a text that is not
    # JSON-clean, still identifies its token)
    return_tokens_as_token_ids: bool = False
    # vLLM's: a request's place in a priority-scheduled queue; the scheduler is first-come first-served, so only 0
    # (vLLM's answer without --scheduling-policy priority)
    priority: int = 0
    # vLLM's beam search: refused when true (answering it with sampling was a different output, silently)
    use_beam_search: bool = False
    user: str | None = None
    # the output held to a constraint: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* fields (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    # vLLM's: only these token ids may be sampled (checked against the vocabulary)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    # vLLM's: only the last k prompt tokens are kept (left truncation) before the context check; -1: as many as
    # leave room for max_tokens (one token without it)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: prefix-cache blocks are shared only with requests of the same salt
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: words never to write (each with and without a leading space; a word of several tokens bans its
    # last token after the others)
    bad_words: list[str] | None = None
    # vLLM extensions that change the output and are not implemented: refused when used (each validator
    # below) rather than ignored, which answered as if they had not been sent
    logits_processors: list[Any] | None = None
    structural_tag: Any = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, value: int | None) -> int | None:
        if value == 0:  # an empty prompt: nothing to continue
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1 (as many as fit the context)")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("bad_words must be non-empty strings")
        return value

    @field_validator("logits_processors")
    @classmethod
    def _unsupported_list(cls, value: list | None, info: ValidationInfo) -> list | None:
        if value:  # vLLM's default is [] / None: an empty list asks for nothing
            raise ValueError(f"{info.field_name} is not supported by this server: leave it out or empty")
        return value

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("structural_tag is not supported: use response_format, structured_outputs or "
                             "guided_* for constrained output")
        return value

    @field_validator(*_GUIDED_FIELDS)
    @classmethod
    def _guided_constraint(cls, value: Any, info: ValidationInfo) -> Any:
        """A malformed guided_* constraint (an empty choice) is a 400 naming its field: raised in the model's
        validator below, it named none."""
        if value is not None:
            StructuredOutput(**{_GUIDED_FIELDS[info.field_name]: value})
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise ValueError("beam search is not supported: leave use_beam_search out or false")
        return value

    @field_validator("priority")
    @classmethod
    def _no_priority_scheduling(cls, value: int) -> int:
        if value != 0:
            raise ValueError(f"got priority {value}, but requests are served first come, first served (no "
                             "priority scheduling): leave it out or 0")
        return value

    @model_validator(mode="after")
    def _check_common(self):
        # vLLM's test (`if data.get("stream_options") and not data.get("stream")`): an empty object asks for nothing,
        # so it passes without stream (an SDK or proxy that always sends one got a 400)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        for token, bias in (self.logit_bias or {}).items():
            if not token.strip().isdecimal():  # isdigit() takes "²", which int() refuses
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            check_logit_bias_value(token, bias)  # a ValueError: pydantic's 400, its param logit_bias
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise ValueError("stop strings must be non-empty")
        self.structured_output()  # one constraint at most, and a well-formed one
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The request's output constraint, from whichever field gives it."""
        return next(iter(self._constraints().values()), None)

    def constraint_field(self) -> str | None:
        """The request field that gives the output constraint."""
        return next(iter(self._constraints()), None)

    def _constraints(self) -> dict[str, StructuredOutput]:
        given = {}
        f = self.response_format
        if f is not None and f.type == "json_object":
            given["response_format"] = StructuredOutput(json_object=True)
        elif f is not None and f.type == "json_schema":
            schema = f.json_schema.schema_
            given["response_format"] = StructuredOutput(json=schema) if schema else StructuredOutput(json_object=True)
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.spec()
        for name, key in _GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = StructuredOutput(**{key: getattr(self, name)})
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(given)}")
        return given

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


# render_chat's own arguments: a second value from chat_template_kwargs broke the render (a TypeError, a 500; vLLM's
# renderer fails on `messages` too). The other keys the server sets are read from the kwargs (SERVER_TEMPLATE_KEYS).
_RESERVED_TEMPLATE_KWARGS = {"messages": "messages", "template": None}
# keys of chat_template_kwargs the server reads itself, not template variables (vLLM's reading): the request's
# add_generation_prompt / continue_final_message fields decide those (vLLM merges its fields over the kwargs, so a
# kwarg of that name changes nothing); `tools` replaces the tools the template renders, not those the parsers read;
# `chat_template` is a template of the request's (serving_chat: --trust-request-chat-template gates it)
SERVER_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template")


def tools_not_empty(tools: list | None) -> list | None:
    """vLLM's and OpenAI's 400: an empty list is neither "no tools" nor a render with tools (the tool_use template)."""
    if tools is not None and not tools:
        raise ValueError("`tools` must not be an empty array: give at least one tool or leave the field out")
    return tools


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs without the variables the renderer takes itself; its tools a list of objects and its
    chat_template a template (another value failed inside the renderer)."""
    for key in sorted(set(kwargs or ()) & set(_RESERVED_TEMPLATE_KWARGS)):
        field = _RESERVED_TEMPLATE_KWARGS[key]
        raise ValueError(f"chat_template_kwargs may not set {key!r}"
                         + (f": use the request's {field!r} field" if field else ": the server passes the template"))
    tools = (kwargs or {}).get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("chat_template_kwargs' tools must be a list of tool objects")
    template = (kwargs or {}).get("chat_template")
    if template is not None and not (isinstance(template, str) and template):
        raise ValueError("chat_template_kwargs' chat_template must be a non-empty string")
    return kwargs


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(check_template_kwargs)]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: str | None = Field(None, min_length=1)  # vLLM's: this request's own template (a trusted server's)
    echo: bool = False  # vLLM's: the answer starts with the last message's content when that is the assistant's
    # OpenAI's reasoning effort: "none" / "minimal" turn a thinking template's thinking off, "low" to "xhigh" (and
    # vLLM's "max") on (enable_thinking, as Qwen3's and Gemma 4's templates read it) where the kwargs do not say
    # it; every value also reaches the template as `reasoning_effort`
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: false leaves reasoning_content (and reasoning) out of the answer; the model still reasons
    include_reasoning: bool = True
    # vLLM's: special tokens (BOS) added on top of the rendered template, which writes its own: off by default
    add_special_tokens: bool = False
    # vLLM's: retrieval documents handed to the template as `documents` (a template without RAG ignores them)
    documents: list[dict[str, str]] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables from chat_template_kwargs, as vLLM merges them: the keys the server reads
        itself (SERVER_TEMPLATE_KEYS) left out, a null value left unset, the documents and reasoning_effort fields
        over the kwargs of those names, and what reasoning_effort implies where the kwargs did not say it."""
        given = self.chat_template_kwargs or {}
        kwargs = {k: v for k, v in given.items() if v is not None and k not in SERVER_TEMPLATE_KEYS}
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            if given.get("enable_thinking") is None:
                # vLLM's rule (enable_thinking = effort != "none"): asking for reasoning turns it on where a
                # template's thinking is opt-in. "minimal" stays off here, unlike vLLM: OpenAI's minimal means
                # (almost) no reasoning, which a thinking template cannot do by degrees
                kwargs["enable_thinking"] = self.reasoning_effort not in ("none", "minimal")
        return kwargs

    def calls_tools(self) -> bool:
        """Tool calls are parsed out of the answer (and forced or held by a grammar): tools given and tool_choice
        other than "none", which OpenAI defines as "the model will not call any tool and instead generates a
        message": a call the model writes anyway comes back as content, as vLLM returns it."""
        return bool(self.tools) and self.tool_choice != "none"

    def renders_tools(self, exclude_when_none: bool) -> bool:
        """The request's tools go into the prompt: with tool_choice "none" too (vLLM's default: the model knows
        they exist, it is only not to call them), unless `exclude_when_none` (--exclude-tools-when-tool-choice-none,
        vLLM's flag) leaves them out then."""
        return bool(self.tools) and (self.tool_choice != "none" or not exclude_when_none)

    def template_tools(self, with_tools: bool) -> list[dict] | None:
        """The tools the template renders: chat_template_kwargs' tools where given (vLLM renders those over the
        request's), else the request's where they are rendered (`with_tools`: renders_tools). Parsers and
        tool_choice read the request's tools whatever this says."""
        given = (self.chat_template_kwargs or {}).get("tools")
        if given is not None:
            return given
        return [t.model_dump(exclude_none=True) for t in self.tools] if with_tools and self.tools else None

    @field_validator("tools")
    @classmethod
    def _tools_not_empty(cls, tools):
        return tools_not_empty(tools)

    @staticmethod
    def check_tool_choice(tool_choice: Any, tools: list | None) -> None:
        """ValueError for a tool_choice the tools cannot serve (none given, or not the function it names)."""
        if tool_choice is not None and tool_choice != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(tool_choice, NamedToolChoice):
            names = [t.function.name for t in tools or ()]
            if tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, "
                                 f"which is not among the tools ({', '.join(names)})")

    @model_validator(mode="after")
    def _check_chat(self):
        pair_function_calls(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        self.check_tool_choice(self.tool_choice, self.tools)
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed_text(self) -> str:
        """What `echo` puts before the answer: the last message's content when it is the assistant's (the message a
        continue_final_message request continues), as vLLM; else nothing."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and last.role == "assistant" else ""

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's (and vLLM's) default for completions; chat: the context. 0 with echo: the prompt scored, nothing
    # generated (vLLM's; what prompt-scoring clients such as lm-evaluation-harness send). An explicit null is the
    # rest of the context, as in vLLM (its default is 16 only when the field is absent)
    max_tokens: int | None = Field(16, ge=0)
    null_is_not_default: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the tokenizer's special tokens (BOS) around a text prompt; false for a prompt already templated
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # vLLM's embeddings input: refused (ignoring it answered the text prompt instead)

    @field_validator("prompt_embeds")
    @classmethod
    def _no_prompt_embeds(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("prompt_embeds is not supported: send the prompt as text or token ids")
        return value

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (must equal n)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is for scoring a prompt: it needs echo true (or ask for at least 1 token)")
        return self

    def scores_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (with its logprobs), no generated token."""
        return self.echo and self.max_tokens == 0

    def output_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs
