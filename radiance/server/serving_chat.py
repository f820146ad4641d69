"""`/v1/chat/completions`: template -> tokens -> n engine requests -> parsed choices (or SSE chunks).

Streaming and non-streaming share one per-choice pipeline (chat_choice.ChoiceStream: reasoning parser, then
tool-call parser), fed with each new piece of text; the non-streaming answer is the sum of the pieces, so both modes
agree on content, reasoning and tool calls. With gpt-oss's harmony format the reasoning parser also hands
over the messages addressed to functions, which the harmony tool-call parser makes calls of.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from radiance.engine.structured_output import StructuredOutput
from radiance.errors import ConfigError
from radiance.server.chat_choice import ChoiceStream
from radiance.server.chat_template import (TemplateError, close_thinking, content_format_of, cut_at_continue_tag,
                                           final_text, prompt_closes_thinking, prompt_opens_thinking, render_chat,
                                           tag_final_message, with_content_format)
from radiance.server.chat_tools import forced_tool_call_constraint, forced_tool_call_prefix, strict_tools_constraint
from radiance.server.errors import JSONAnswer, OpenAIError, invalid
from radiance.server.protocol import ChatCompletionRequest, NamedToolChoice
from radiance.server.response_bodies import now, usage
from radiance.server.logprobs_json import prompt_logprobs_json
from radiance.server.serving_common import (EngineJob, check_limits, collect_until_disconnect, encode_prompt,
                                            engine_request_id, guarded_sse, merged_outputs, resolve_max_tokens,
                                            response_id, sampling_params, sse, StreamUsage, truncate_prompt)
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)


def _messages(req: ChatCompletionRequest, template: str, content_format: str) -> list[dict]:
    """The request's messages as the template reads them: content as one string or as OpenAI's text parts
    (ServerConfig.chat_template_content_format, resolved for this template as vLLM does)."""
    out = []
    for message in req.messages:
        item = message.model_dump(exclude_none=True)
        item["content"] = message.text() if not isinstance(message.content, list) else [
            {"type": "text", "text": part.text} for part in message.content]
        out.append(item)
    return with_content_format(out, content_format_of(template, content_format))


def _request_template(state: ServerState, req: ChatCompletionRequest) -> tuple[str | None, str]:
    """The request's own template where the server trusts them (vLLM's --trust-request-chat-template gates both
    its chat_template field and a chat_template in its chat_template_kwargs), and the parameter it came in. As
    vLLM: the field, else the server's --chat-template, over the kwargs' template (which is over the model's)."""
    in_kwargs = (req.chat_template_kwargs or {}).get("chat_template")
    if req.chat_template is None and in_kwargs is None:
        return None, "chat_template"
    param = "chat_template" if req.chat_template is not None else "chat_template_kwargs"
    if not state.config.trust_request_chat_template:
        raise invalid(f"a request's own chat template ({param}) is refused: a template is code the server runs "
                      "(start it with --trust-request-chat-template to allow them, or --chat-template for one of "
                      "its own)", param=param)
    if req.chat_template is not None:
        return req.chat_template, param
    return (None if state.config.chat_template else in_kwargs), param


def render_prompt(state: ServerState, req: ChatCompletionRequest, with_tools: bool, **template_kwargs: Any) -> str:
    """The request's prompt, its tools in it where `with_tools` (req.renders_tools); `template_kwargs` over the
    request's own (thinking_before_answer's probe)."""
    own, template_param = _request_template(state, req)
    tools = req.template_tools(with_tools)
    # the model's "tool_use" template for a render with tools (transformers' pick), the kwargs' tools included
    template = own or (state.tool_chat_template if tools is not None else None) or state.chat_template
    if not template:
        raise invalid("this model has no chat template; pass one with --chat-template or use /v1/completions",
                      param="messages")
    tok = state.tokenizer
    kwargs = {**req.template_kwargs(), **template_kwargs}
    kwargs.setdefault("bos_token", getattr(tok, "bos_token", None) or "")
    kwargs.setdefault("eos_token", getattr(tok, "eos_token", None) or "")
    messages = _messages(req, template, state.config.chat_template_content_format)
    final = final_text(messages[-1])
    if req.continue_final_message:  # marked, to cut the prompt where the template wrote the message's end
        messages = tag_final_message(messages)
    try:
        prompt = render_chat(template, messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                             **kwargs)
    except TemplateError as exc:
        raise invalid(str(exc), param="messages") from exc
    except ConfigError as exc:  # only a request's own template can fail to parse here: the server's was checked
        raise invalid(str(exc), param=template_param) from exc
    if req.continue_final_message:
        prompt = cut_at_continue_tag(prompt, final)
        if prompt is None:
            raise invalid("continue_final_message: the chat template does not write the final message's content",
                          param="messages")
    return prompt


async def answer_constraint(state: ServerState, req: ChatCompletionRequest, constraint: StructuredOutput,
                            reasoning: str) -> StructuredOutput:
    """response_format / guided_* hold the answer, after the model's reasoning in format `reasoning`
    (structured_output.REASONING_BEFORE), which runs free, as vLLM applies a grammar only once its reasoning
    parser saw the reasoning end:
      - "think": a <think> block the prompt opened (Qwen3 with thinking on): free text up to </think>, then the
        constrained answer (the reasoning parser splits them into reasoning_content and content);
      - "optional_think": the prompt opened no block, but the model may open one first (Qwen3's hybrid template
        with thinking on, DeepSeek-R1-style models): <think> free text </think>, then the answer, or the answer
        alone, held from the first token (thinking_before_answer);
      - "harmony": gpt-oss answers in the final channel, after any analysis messages: the constraint holds that
        message's body alone (gpt-oss has no mode without analysis), not the text after <|start|>assistant. A
        continued final message (continue_final_message) is already in its body."""
    if constraint.after_reasoning is not None or (reasoning == "harmony" and req.continue_final_message):
        return constraint
    try:
        spec = replace(constraint, after_reasoning=reasoning)
        await state.engine.check_structured_output(spec)
    except ValueError as exc:
        raise invalid(str(exc), param=req.constraint_field()) from None
    return spec


def thinking_before_answer(state: ServerState, req: ChatCompletionRequest, prompt: str, opens_thinking: bool,
                           with_tools: bool) -> str | None:
    """The <think> block a constraint lets run free before the text it holds (structured_output.REASONING_BEFORE),
    with the think reasoning parser to set it apart: "think" when the prompt opened it; "optional_think" when the
    model may open one as its first text (the prompt opened none and thinking is on: Qwen3's hybrid template,
    DeepSeek-R1-style models); None when thinking is off (enable_thinking false, reasoning_effort none / minimal,
    the template closed the block in the prompt, or its thinking is opt-in: asked with enable_thinking it would
    open the block) or the model continues a message it began: the answer is held from the start.
    vLLM applies the grammar only once the reasoning parser saw </think>, so a model there that does not think is
    never held; here it is held from its first token, and one that thinks, from the block's end.
    With the mistral reasoning parser (Magistral, which thinks when its system prompt asks): "optional_mistral_think",
    a [THINK] block the model may open first."""
    if state.reasoning_parser_name == "mistral":
        return None if req.continue_final_message or not req.add_generation_prompt else "optional_mistral_think"
    if state.reasoning_parser_name != "think":
        return None
    if opens_thinking:
        return "think"
    kwargs = req.template_kwargs()
    if (req.continue_final_message or not req.add_generation_prompt or kwargs.get("enable_thinking") is False
            or prompt_closes_thinking(prompt)):
        return None
    if "enable_thinking" not in kwargs:  # a template that thinks only when asked has thinking off by default
        last_content = req.messages[-1].text() if req.messages else ""
        try:
            asked = render_prompt(state, req, with_tools, enable_thinking=True)
        except OpenAIError:
            asked = prompt
        if prompt_opens_thinking(asked, last_content):
            return None
    return "optional_think"


@dataclass
class PreparedChat:
    """A chat request made ready for the engine: its prompt, one engine job and one parser per choice."""

    prompt_ids: list[int]
    jobs: list[EngineJob]
    choices: list[ChoiceStream]


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, request_id: str) -> PreparedChat:
    """Limits, template, forced tool-call prefix and constraint, tokens, sampling: everything a chat request
    (or a Responses request turned into one) does before it reaches the engine."""
    # a chat prompt is text: without a tokenizer nothing below can serve it, and its cause (a broken GGUF field)
    # is the one to name, not the "no chat template" that rendering would answer first
    state.require_tokenizer("messages")
    await check_limits(state, req)
    # tool_choice "none": the tools are in the prompt (unless the server excludes them) but no call is parsed,
    # forced or held by a grammar: `tools` (the parsers' and grammars') stays None
    use_tools = req.calls_tools()
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
    with_tools = req.renders_tools(state.config.exclude_tools_when_tool_choice_none)
    prompt = await state.off_loop(render_prompt, state, req, with_tools)
    forced_prefix = forced_tool_call_prefix(state, req) if use_tools else ""
    last_content = req.messages[-1].text() if req.messages else ""
    opens_thinking = prompt_opens_thinking(prompt, last_content, req.continue_final_message)
    # a forced call or response_format / guided_* holds the answer, not the reasoning of a <think> block the
    # template opened: with the think reasoning parser to split them, the reasoning runs free and the constraint
    # holds the text after </think> (vLLM's rule), so a forced call's opening comes after </think>, not at the end
    # of the prompt; without it the block is closed empty first (nothing would tell the reasoning from the answer).
    # A block the model may open itself (thinking_before_answer) is optional before the constraint, the same way.
    constrained = bool(forced_prefix) or req.structured_output() is not None or (
        use_tools and any(t.function.strict for t in req.tools))
    thinking = thinking_before_answer(state, req, prompt, opens_thinking, with_tools) if constrained else None
    think_first = thinking == "think"
    forced = bool(forced_prefix)
    if forced:
        constraint = await forced_tool_call_constraint(state, req, tools, after_reasoning=thinking)
    elif use_tools:
        constraint = (await strict_tools_constraint(state, req, tools, "think" if opens_thinking else thinking)
                      or req.structured_output())
    else:
        constraint = req.structured_output()
    if constraint is not None and not forced and state.reasoning_parser_name == "harmony":
        constraint = await answer_constraint(state, req, constraint, "harmony")
    elif constraint is not None and not forced and thinking is not None:
        constraint = await answer_constraint(state, req, constraint, thinking)
    if opens_thinking and not think_first and (forced or req.structured_output() is not None):
        prompt, opens_thinking = close_thinking(prompt), False
    if thinking is not None:
        forced_prefix = ""  # the model writes the call's opening after its reasoning: the parsers read it there
    prompt += forced_prefix
    prompt_ids = await state.off_loop(encode_prompt, state, prompt, "messages", req.truncate_prompt_tokens is not None,
                                      add_special_tokens=req.add_special_tokens)  # the template writes its own
    prompt_ids = truncate_prompt(state, prompt_ids, req)
    max_tokens = resolve_max_tokens(state, len(prompt_ids), req.output_limit(),
                                    "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                                    "messages")
    named_tool = forced and isinstance(req.tool_choice, NamedToolChoice)
    choices = [ChoiceStream(state, i, tools, opens_thinking, forced_prefix, named_tool,
                            req.return_tokens_as_token_ids, req.parallel_tool_calls, req.include_reasoning,
                            req.skip_special_tokens)
               for i in range(req.n)]
    jobs = [EngineJob(engine_request_id(request_id, i), prompt_ids,
                      sampling_params(req, max_tokens, i, constraint, state.sampling_defaults,
                                      keep_special_tokens=choice.needs_special_tokens))
            for i, choice in enumerate(choices)]
    return PreparedChat(prompt_ids, jobs, choices)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    engine = state.require_engine()
    model = state.check_model(req.model)
    lora_request = state.lora_request(model)  # read with the name, before any await: an unload cannot come between
    request_id = response_id("chatcmpl")
    chat = await prepare_chat(state, req, request_id)
    choices = chat.choices
    outputs = merged_outputs(engine, chat.jobs, state.metrics, n=req.n, lora_request=lora_request)
    echoed = req.echoed_text()
    if req.stream:
        stream = _stream(request_id, model, outputs, choices, len(chat.prompt_ids), StreamUsage(req.stream_options),
                         echoed)
        return StreamingResponse(stream, media_type="text/event-stream")
    deltas: list[dict] = [{} for _ in choices]
    # asked for: a list even when no token's logprob goes out (a stop on the first token), as OpenAI answers
    logprobs: list[list | None] = [[] if req.logprobs and not c.hides_logprobs else None for c in choices]

    def on_output(index: int, out: Any) -> None:
        delta, lp = choices[index].step(out)
        _merge_delta(deltas[index], delta)
        if lp is not None:
            logprobs[index] = (logprobs[index] or []) + lp["content"]

    await collect_until_disconnect(request, outputs, on_output)
    body = _response(request_id, model, choices, deltas, logprobs, len(chat.prompt_ids), echoed)
    if req.prompt_logprobs is not None:  # vLLM's top-level field: the prompt's, which every choice shares
        first = choices[0].output
        body["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, first.prompt_logprobs if first else None,
                                                       req.return_tokens_as_token_ids)
    return JSONAnswer(body)


def _merge_delta(total: dict, delta: dict) -> None:
    for key, value in delta.items():
        if key == "tool_calls":
            total.setdefault(key, []).extend(value)
        else:
            total[key] = total.get(key, "") + value


def _response(request_id: str, model: str, choices: list[ChoiceStream], deltas: list[dict],
              logprobs: list[list | None], prompt_len: int, echoed: str = "") -> dict:
    body_choices = []
    for choice, delta, lp in zip(choices, deltas, logprobs):
        content = echoed + (delta.get("content") or "")
        # refusal: OpenAI's and vLLM's message carry it, null (the model's refusals are not told apart)
        message = {"role": "assistant", "content": content or (None if delta.get("tool_calls") else ""),
                   "refusal": None}
        if "reasoning_content" in delta:
            message["reasoning_content"] = message["reasoning"] = delta["reasoning_content"]
        if delta.get("tool_calls"):
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
        body_choices.append({"index": choice.index, "message": message,
                             "logprobs": None if lp is None else {"content": lp},
                             "finish_reason": choice.finish_reason(), "stop_reason": choice.stop_reason()})
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": body_choices, "usage": _usage(choices, prompt_len)}


def _usage(choices: list[ChoiceStream], prompt_len: int) -> dict:
    """The request's usage, the same whether it streamed or not."""
    finals = [c.output for c in choices if c.output is not None]
    completion_tokens = sum(len(f.token_ids) for f in finals)
    cached = max((f.num_cached_tokens for f in finals), default=0)
    return usage(prompt_len, completion_tokens, cached)


def _stream(request_id: str, model: str, outputs: AsyncIterator, choices: list[ChoiceStream], prompt_len: int,
            stream_usage: StreamUsage, echoed: str = "") -> AsyncIterator[str]:
    created = now()

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                             "stop_reason": stop_reason}]}
        return stream_usage.add_to_chunk(body, prompt_len, choices[index].output)

    def opening() -> Iterator[str]:  # vLLM's: every choice's role chunk, then every choice's echo
        for choice in choices:
            yield sse(chunk(choice.index, {"role": "assistant", "content": ""}))
        for choice in choices if echoed else ():
            yield sse(chunk(choice.index, {"content": echoed}))

    async def events() -> AsyncIterator[str]:
        opened = False
        async for index, out in outputs:
            if not opened:  # vLLM's order: the role chunks come with the first output, so a client's first
                opened = True  # chunk times the prefill (a benchmark's TTFT), not the request's arrival
                for event in opening():
                    yield event
            choice = choices[index]
            delta, logprobs = choice.step(out)
            # vLLM's: the last delta and the finish reason in one chunk; but a tool call first seen in the chunk
            # that finishes gets no "arguments done" event from the openai client, so tool calls come before it
            if out.finished and "tool_calls" not in delta:
                yield sse(chunk(index, delta, logprobs, choice.finish_reason(), choice.stop_reason()))
                continue
            if delta or logprobs:
                yield sse(chunk(index, delta, logprobs))
            if out.finished:
                yield sse(chunk(index, {}, None, choice.finish_reason(), choice.stop_reason()))
        if not opened:
            for event in opening():
                yield event
        if stream_usage.final:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": _usage(choices, prompt_len)})

    return guarded_sse(events(), outputs, f"chat stream {request_id}")
