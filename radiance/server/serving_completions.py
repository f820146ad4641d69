"""`/v1/completions`: one or more prompts (text or token ids), n choices each, streamed or not.

Choice index = prompt index * n + choice number, as OpenAI numbers them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from radiance.engine.outputs import TokenLogprob
from radiance.engine.request_checks import check_not_empty
from radiance.server.errors import JSONAnswer, OpenAIError
from radiance.server.protocol import CompletionRequest
from radiance.server.response_bodies import now, usage
from radiance.server.logprobs_json import LogprobCursor, completion_logprobs, prompt_logprobs_json
from radiance.server.serving_common import (EngineJob, check_limits, check_token_ids, collect_until_disconnect,
                                            encode_prompt, engine_request_id, merged_outputs, request_checked,
                                            resolve_max_tokens, guarded_sse, response_id, sampling_params, sse,
                                            StreamUsage, truncate_prompt)
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)


async def _prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) per prompt."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # one prompt
    prompts = []
    with request_checked():  # the shared checks' errors as 400s naming prompt / prompt[i]
        check_not_empty(raw, "prompt")
        for i, item in enumerate(raw):
            param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            check_not_empty(item, param)  # an empty text too, before it is tokenized
            truncating = req.truncate_prompt_tokens is not None
            if isinstance(item, str):
                ids = await state.off_loop(encode_prompt, state, item, param, truncating,
                                           add_special_tokens=req.add_special_tokens)
            else:
                check_token_ids(state, item, param)
                ids, item = list(item), None
            kept = truncate_prompt(state, ids, req)
            if item is None or len(kept) < len(ids):  # echo gives the prompt the model saw
                item = state.tokenizer.decode(kept) if state.tokenizer is not None else ""
            prompts.append((item, kept))
    return prompts


class CompletionChoice:
    def __init__(self, state: ServerState, index: int, prompt_text: str, echo: bool, prompt_tokens: int = 0,
                 logprobs: int | None = None, token_ids_as_names: bool = False, scores_only: bool = False,
                 skip_special_tokens: bool = True):
        self.index = index
        self.scores_only = scores_only  # echo with max_tokens 0: the token generated to score the prompt is dropped
        self.logprobs = logprobs  # the request's: an echoed prompt's alternatives too
        self.token_ids_as_names = token_ids_as_names  # vLLM's return_tokens_as_token_ids
        self.prompt_tokens = prompt_tokens
        self.tokenizer = state.tokenizer
        self.prefix = prompt_text if echo else ""
        self.sent_chars = 0
        self.echoed = False
        self.logprob_cursor = LogprobCursor(state.tokenizer, skip_special_tokens)
        self.output: Any = None

    def step(self, out: Any) -> tuple[str, dict | None]:
        if self.scores_only:  # as vLLM answers it: the prompt, its logprobs, finish_reason length, no output tokens
            out = dataclasses.replace(out, text="", token_ids=[], logprobs=[] if out.logprobs is not None else None,
                                      cumulative_logprob=None, stop_reason=None,
                                      finish_reason="length" if out.finished else None)
        self.output = out
        text = out.text[self.sent_chars:]
        parts = []
        if not self.echoed:  # the prompt goes out once, with the first output (which may be empty)
            text = self.prefix + text
            self.echoed = True
            if self.prefix and self.logprobs is not None and out.prompt_logprobs is not None:
                # echo with logprobs: the prompt's come first (scored with prompt_logprobs' alternatives if more)
                prompt = [TokenLogprob(out.prompt_token_ids[0], None)] + [
                    TokenLogprob(e.token_id, e.logprob, e.top[:self.logprobs]) for e in out.prompt_logprobs[1:]]
                parts.append(completion_logprobs(self.tokenizer, prompt, 0, self.token_ids_as_names))
        self.sent_chars = len(out.text)
        released = self.logprob_cursor.release(out, self.sent_chars)
        if released is not None:
            entries, texts, offset = released
            parts.append(completion_logprobs(self.tokenizer, entries, len(self.prefix) + offset,
                                             self.token_ids_as_names, texts, self.logprob_cursor.textless))
        logprobs = {key: [v for part in parts for v in part[key]] for key in parts[0]} if parts else None
        return text, logprobs


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    engine = state.require_engine()
    model = state.check_model(req.model)
    lora_request = state.lora_request(model)  # read with the name, before any await: an unload cannot come between
    await check_limits(state, req)
    prompts = await _prompts(state, req)
    if req.logprobs is not None:  # logprobs carry each token's text: refused before generating, not a 500 after
        state.require_tokenizer("logprobs", hint="logprobs need it for the tokens' texts")
    request_id = response_id("cmpl")
    jobs, choices = [], []
    for p, (text, ids) in enumerate(prompts):
        try:
            max_tokens = resolve_max_tokens(state, len(ids), 1 if req.scores_only() else req.output_limit(),
                                            "max_tokens", "prompt" if len(prompts) == 1 else f"prompt[{p}]")
        except OpenAIError as exc:
            if exc.code == "context_length_exceeded" and "max_tokens" not in req.model_fields_set:
                # OpenAI's and vLLM's refusal of the default 16: say where a 16 the client never sent came from
                exc.message += (" max_tokens was not sent: completions default to 16 (send a smaller one, or null for "
                                "the rest of the context).")
            raise
        for i in range(req.n):
            index = p * req.n + i
            jobs.append(EngineJob(engine_request_id(request_id, index), ids,
                                  sampling_params(req, max_tokens, i, req.structured_output(),
                                                  state.sampling_defaults)))
            choices.append(CompletionChoice(state, index, text, req.echo, len(ids), req.logprobs,
                                            req.return_tokens_as_token_ids, req.scores_only(),
                                            req.skip_special_tokens))
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    outputs = merged_outputs(engine, jobs, state.metrics, n=req.n, lora_request=lora_request)
    if req.stream:
        stream = _stream(request_id, model, outputs, choices, prompt_tokens, req.n, StreamUsage(req.stream_options))
        return StreamingResponse(stream, media_type="text/event-stream")

    texts = ["" for _ in choices]
    # asked for: the object even when no token's logprob goes out (a stop on the first token), as OpenAI answers
    logprobs: list[dict | None] = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                                   if req.logprobs is not None else None for _ in choices]

    def on_output(index: int, out: Any) -> None:
        text, lp = choices[index].step(out)
        texts[index] += text
        if lp is not None:
            for key, values in lp.items():
                logprobs[index][key].extend(values)

    await collect_until_disconnect(request, outputs, on_output)
    body_choices = [{"index": c.index, "text": texts[c.index], "logprobs": logprobs[c.index],
                     "finish_reason": c.output.finish_reason, "stop_reason": c.output.stop_reason} for c in choices]
    if req.prompt_logprobs is not None:  # vLLM's field of each choice
        for body, c in zip(body_choices, choices):
            body["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, c.output.prompt_logprobs,
                                                           req.return_tokens_as_token_ids)
    return JSONAnswer({"id": request_id, "object": "text_completion", "created": now(), "model": model,
                         "choices": body_choices, "usage": _usage(choices, prompt_tokens, req.n)})


def _usage(choices: list[CompletionChoice], prompt_tokens: int, n: int) -> dict:
    """The request's usage, the same whether it streamed or not. Cached prompt tokens count once per prompt
    (its n choices share it: the most any of them found in the prefix cache), as the prompt tokens do."""
    finals = [c.output for c in choices if c.output is not None]
    completion_tokens = sum(len(f.token_ids) for f in finals)
    cached = sum(max((c.output.num_cached_tokens for c in choices[p:p + n] if c.output is not None), default=0)
                 for p in range(0, len(choices), n))
    return usage(prompt_tokens, completion_tokens, cached)


def _stream(request_id: str, model: str, outputs: AsyncIterator, choices: list[CompletionChoice],
            prompt_tokens: int, n: int, stream_usage: StreamUsage) -> AsyncIterator[str]:
    created = now()

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                             "stop_reason": stop_reason}]}
        return stream_usage.add_to_chunk(body, choices[index].prompt_tokens, choices[index].output)

    async def events() -> AsyncIterator[str]:
        async for index, out in outputs:
            text, logprobs = choices[index].step(out)
            if text or logprobs or out.finished:
                ending = (out.finish_reason, out.stop_reason) if out.finished else ()
                yield sse(chunk(index, text, logprobs, *ending))
        if stream_usage.final:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": _usage(choices, prompt_tokens, n)})

    return guarded_sse(events(), outputs, f"completion stream {request_id}")
