"""What chat and text completions share: limits, sampling params, fan-out of `n` choices, disconnects, SSE framing
(token logprobs as JSON: logprobs_json).

A request with n choices becomes n engine requests (`<id>-<i>-<8 random hex>`, seed + i when a seed is
given); their outputs are merged into one stream. Whatever way a request ends (finished, client gone,
error), engine requests still running are aborted so their KV blocks return to the pool, and each engine
request ends exactly once in the metrics (its finish reason, `abort` or `error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.engine import request_checks
from radiance.engine.async_engine import EngineDeadError
from radiance.engine.sampling_params import SamplingParams
from radiance.engine.structured_output import StructuredOutput
from radiance.server.errors import OpenAIError, internal_error, invalid, json_text, sse_error
from radiance.server.metrics import ABORT, ERROR, RequestTimer, ServerMetrics, current_request
from radiance.server.response_bodies import new_id, usage
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.2


@dataclass
class EngineJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def response_id(prefix: str) -> str:
    """A response body's id: `<prefix>-<X-Request-Id>`, the client's header (vLLM's _base_request_id, so a client
    finds its request by its own id) or the one the server made and sent back in that header, which tags the
    request's log lines; a new random one outside a request."""
    served = current_request.get()
    if served is not None:
        return f"{prefix}-{served.request_id}"
    return new_id(prefix)


def engine_request_id(response: str, index: int) -> str:
    """Choice `index`'s engine request id: random-suffixed (as vLLM's engine suffixes every id), so two
    requests that share an X-Request-Id (a retry, a fixed proxy id) never collide inside the engine."""
    return f"{response}-{index}-{uuid.uuid4().hex[:8]}"


async def check_limits(state: ServerState, req: Any) -> None:
    if req.n > state.config.max_n:
        raise invalid(f"n must be at most {state.config.max_n}, got {req.n}", param="n")
    wanted = req.num_logprobs()
    if wanted is not None and wanted > state.config.max_logprobs:
        name = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
        raise invalid(f"{name} must be at most {state.config.max_logprobs}, got {wanted}", param=name)
    if req.logit_bias:
        check_token_ids(state, [int(t) for t in req.logit_bias], "logit_bias")
    if req.allowed_token_ids:
        check_token_ids(state, req.allowed_token_ids, "allowed_token_ids")
    if req.stop_token_ids:  # a 400 before a stream starts (the engine checks them too)
        check_token_ids(state, req.stop_token_ids, "stop_token_ids")
    if req.bad_words:  # tokenized as the engine will (cached): a 400 before a stream starts, not an error event
        tokenizer = state.require_tokenizer("bad_words", hint="bad_words are tokenized with it")
        with request_checked():
            ids = await state.off_loop(request_checks.tokenize_bad_words, req.bad_words, tokenizer,
                                       state.max_token_chars)
            request_checks.check_bad_words_token_ids(ids, state.vocab_size())
    spec = req.structured_output()
    if spec is not None:
        try:
            await state.engine.check_structured_output(spec)  # compiles it (cached for the engine's own use)
        except ValueError as exc:
            raise invalid(str(exc), param=req.constraint_field()) from None


@contextlib.contextmanager
def request_checked():
    """The engine's RequestError as a 400 whose param is its field (the app's RadianceError handler names
    none); a context overflow in OpenAI's words, with its code context_length_exceeded."""
    try:
        yield
    except request_checks.ContextLengthError as exc:
        raise invalid(_context_length_message(exc), param=exc.field, code="context_length_exceeded") from None
    except request_checks.RequestError as exc:
        raise invalid(str(exc), param=exc.field) from None


def _context_length_message(exc: request_checks.ContextLengthError) -> str:
    limit, prompt = exc.context, exc.prompt_tokens
    if exc.max_tokens is None:
        return (f"This model's maximum context length is {limit} tokens, but the prompt has {prompt} tokens, "
                "which leaves no room for output.")
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + exc.max_tokens} tokens ({prompt} in the prompt, {exc.max_tokens} for the completion). "
            f"Please reduce the prompt or {exc.field}.")


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    with request_checked():
        request_checks.check_token_ids(ids, state.vocab_size(), param)


def encode_prompt(state: ServerState, text: str, param: str, truncating: bool = False, **encode_kw: Any) -> list[int]:
    """A prompt's token ids. A text too long for the context by its length alone (each token spans at most
    state.max_token_chars characters) is a 400 before tokenizing: a 10 MB message took 13 s to tokenize on a
    2-core CPU, and the server answered nothing else meanwhile. Not when `truncating` (truncate_prompt_tokens):
    there a prompt longer than the context is what the client asked to be cut."""
    chars, limit = len(text), state.max_model_len
    if state.max_token_chars and chars > limit * state.max_token_chars and not truncating:
        raise invalid(f"This model's maximum context length is {limit} tokens, but the prompt has {chars} "
                      f"characters: more than {chars // state.max_token_chars} tokens.", param=param,
                      code="context_length_exceeded")
    check_unicode(text, param)
    if state.tokenizer is None:  # a 400 naming why there is none, not an AttributeError's 500
        state.require_tokenizer(param)
    return state.tokenizer.encode(text, **encode_kw)


def truncate_prompt(state: ServerState, ids: list[int], req: Any) -> list[int]:
    """The request's truncate_prompt_tokens (request_checks.truncate_prompt); a k past the room the output limit
    leaves is a 400, as in vLLM."""
    with request_checked():
        return request_checks.truncate_prompt(ids, req.truncate_prompt_tokens, state.max_model_len,
                                              req.output_limit())


def vocabulary_strings(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token as its vocabulary names it (vLLM's /tokenize token_strs: "Ġthe" for " the" in byte-level
    vocabularies); a tokenizer without names gives each token's decoded text."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return list(convert(token_ids))
    return [tokenizer.decode([token]) for token in token_ids]


def check_unicode(text: str, param: str) -> None:
    """A lone UTF-16 surrogate (JSON's "\\ud800") parses into a Python str but is no Unicode text: tokenizers
    raise on it (TypeError, UnicodeEncodeError), which was a 500. Worded for JSON, where it comes from."""
    at = request_checks.lone_surrogate_at(text)
    if at is not None:
        raise invalid(f"{param} holds a lone UTF-16 surrogate (\\u{ord(text[at]):04x}), which is not valid "
                      "Unicode text", param=param)


def resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None, param: str,
                       prompt_param: str) -> int:
    """Output budget; prompt + max_tokens must fit the context, and the message gives both numbers. `param`
    names the request's output limit, `prompt_param` its prompt (messages, prompt, prompt[i]). The model's
    generation_config max_new_tokens (under --generation-config auto) caps it, as in vLLM."""
    with request_checked():
        request_checks.check_fits_context(prompt_len, state.max_model_len, prompt_param, requested, param)
    budget = state.max_model_len - prompt_len if requested is None else requested
    cap = state.sampling_defaults.max_tokens
    return budget if cap is None else min(budget, cap)


def sampling_params(req: Any, max_tokens: int, choice: int, constraint: StructuredOutput | None,
                    defaults: SamplingDefaults, keep_special_tokens: bool = False) -> SamplingParams:
    """The engine's parameters for choice `choice` of a request, its output held to `constraint` (the
    request's own structured output, or a forced tool call's); a sampling field the request leaves out takes
    `defaults` (the model's generation_config.json), then OpenAI's; `keep_special_tokens` overrides the
    request's skip_special_tokens for a parser that reads special-token markup."""
    def given(name: str, openai_default):
        value = getattr(req, name)
        value = getattr(defaults, name) if value is None else value
        return openai_default if value is None else value

    top_k = given("top_k", -1)
    # built with the request's n and seed, then taken to this choice: vLLM's checks of n (greedy needs n 1: a 400)
    # and seed (-1 is none, for every choice) hold
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
        temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=-1 if top_k == 0 else top_k,
        min_p=given("min_p", 0.0),
        seed=req.seed, stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos, logprobs=req.num_logprobs(),
        skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
        prompt_logprobs=scored_prompt_logprobs(req),
        logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
        allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
        cache_salt=req.cache_salt, bad_words=tuple(req.bad_words or ()),
        repetition_penalty=given("repetition_penalty", 1.0),
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        structured_output=constraint,
    ).for_choice(choice)


def scored_prompt_logprobs(req: Any) -> int | None:
    """The alternatives the engine scores per prompt token: the request's prompt_logprobs, and as many as its
    logprobs for a completion's echo (each use keeps its own count)."""
    wanted = [n for n in (req.prompt_logprobs, req.num_logprobs() if getattr(req, "echo", False) else None)
              if n is not None]
    return max(wanted) if wanted else None


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


_REFUSED = "refused"  # a job's failure that is no end in the metrics: the engine refused it up front


async def merged_outputs(engine: Any, jobs: list[EngineJob], metrics: ServerMetrics, n: int = 1,
                         lora_request: Any = None) -> AsyncIterator[tuple[int, Any]]:
    """(job index, StepOutput) from all jobs as they come; aborts unfinished jobs on exit. Each job ends
    once in `metrics`: its finish reason; `error` when the engine failed it; `abort` when the request ended
    first (client gone, server stopping, a sibling choice's failure). Each run of `n` jobs are one prompt's
    choices, which its per-prompt metrics (n, the longest choice) count once they all ended. Every job runs
    with `lora_request` (the adapter the request's model names; None: the base model)."""
    # passed only when there is one: an engine without LoRA (a test's stand-in) takes no such argument
    adapter = {} if lora_request is None else {"lora_request": lora_request}
    # bounded: a client that stops reading stops the pumps too, and the engine's OutputSlot keeps only the
    # newest output of each job meanwhile (an unbounded queue held a cumulative copy per step)
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(jobs))
    finished: set[int] = set()
    failures: dict[int, str] = {}  # job index -> how its failure ends it in the metrics
    timers = [RequestTimer(metrics, num_prompt_tokens=len(job.prompt_token_ids), max_tokens=job.params.max_tokens)
              for job in jobs]
    done_marker = object()

    async def pump(index: int, job: EngineJob) -> None:
        produced = False
        try:
            async for out in engine.generate(job.request_id, job.prompt_token_ids, job.params, **adapter):
                produced = True
                await queue.put((index, out))
            await queue.put((index, done_marker))
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:  # logged once by the engine loop; every request gets the same clean 500
            failures[index] = ERROR
            await queue.put((index, engine_dead(exc)))
        except ValueError as exc:  # the engine refused the request up front: the client's fault
            failures[index] = ERROR if produced else _REFUSED
            await queue.put((index, invalid(str(exc)) if not produced else exc))
        except BaseException as exc:  # handed to the consumer, which turns it into an HTTP error
            failures[index] = ERROR
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        while len(finished) < len(jobs):
            index, item = await queue.get()
            if item is done_marker:  # the engine's stream ended; without a finished output, the job was aborted
                finished.add(index)
                timers[index].finished(ABORT)
                continue
            if isinstance(item, BaseException):
                raise item
            timers[index].tokens(len(item.token_ids), item.times, item.num_cached_tokens)
            if item.finished:
                finished.add(index)
                timers[index].finished(item.finish_reason)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        unfinished = [index for index in range(len(jobs)) if index not in finished]
        for index in unfinished:
            _end_unfinished(engine, jobs[index].request_id, timers[index], failures.get(index, ABORT))
        _prompts_ended(metrics, timers, n)
        for index in unfinished:
            try:
                await _maybe_await(engine.abort(jobs[index].request_id))
            except Exception:  # noqa: BLE001 - aborting is best effort; never mask the real error
                logger.exception("abort of %s failed", jobs[index].request_id)


def _end_unfinished(engine: Any, request_id: str, timer: RequestTimer, reason: str) -> None:
    """Recorded before the engine's abort, so the metrics are there once the engine is idle. A request admitted
    but ended before its first output has prefix-cache hits no output told: asked of the engine (an engine
    without the method, a test's, leaves them unknown)."""
    if reason == _REFUSED:
        timer.discard()
        return
    lookup, cached = getattr(engine, "num_cached_tokens", None), None
    try:
        cached = lookup(request_id) if callable(lookup) else None
    except Exception:  # noqa: BLE001 - it runs while unwinding: the end and the abort must still happen
        logger.debug("cached tokens of %s unknown", request_id, exc_info=True)
    timer.finished(reason, num_cached_tokens=cached)


def _prompts_ended(metrics: ServerMetrics, timers: list[RequestTimer], n: int) -> None:
    """vLLM's per-prompt metrics, once every choice ended; none for a prompt the engine refused (it never ran)."""
    for start in range(0, len(timers), n):
        choices = timers[start:start + n]
        if not any(timer.refused for timer in choices):
            metrics.prompt_ended(len(choices), max(timer.num_tokens for timer in choices))


def engine_dead(exc: EngineDeadError) -> OpenAIError:
    return OpenAIError(500, f"{exc}; restart the server")


async def collect_until_disconnect(request: Request, outputs: AsyncIterator[tuple[int, Any]],
                                   on_output: Callable[[int, Any], None]) -> None:
    """Drive a non-streaming request to its end; a client that goes away aborts the work."""

    async def consume():
        async for index, out in outputs:
            on_output(index, out)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                logger.info("client disconnected; request aborted")
                raise OpenAIError(499, "client disconnected")
        task.result()  # re-raises an engine error
    finally:
        if not task.done():
            task.cancel()
        # let the cancelled consumer leave the generator before closing it (aclose() on a generator
        # that is still running raises, which would turn a disconnect into a 500)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await outputs.aclose()


async def guarded_sse(events: AsyncIterator[str], outputs: AsyncIterator, what: str,
                      error_event: Callable[[OpenAIError], str] = sse_error, done: bool = True,
                      cancelled_event: Callable[[OpenAIError], str] | None = None) -> AsyncIterator[str]:
    """A stream's events, then `data: [DONE]` (when `done`; the Responses API sends none). The headers are
    already out, so a failure mid-way is reported in-band as `error_event` (no traceback to the client), a
    cancellation as `cancelled_event` (default: `error_event`); the engine outputs are closed whatever happens,
    which aborts their requests when the client went away."""
    try:
        async for event in events:
            yield event
    except OpenAIError as exc:
        yield error_event(exc)
    except asyncio.CancelledError:
        # the server shuts down (uvicorn cancels what still runs after its graceful timeout) or the client left
        # (then the events below go nowhere): the stream ends as a stream, not cut mid-way. Nothing here awaits
        # (that would meet the cancellation again): the events go out as the response sends them
        yield (cancelled_event or error_event)(OpenAIError(503, "the server is shutting down"))
    except Exception as exc:  # noqa: BLE001 - reported in-band and logged
        logger.exception("%s failed", what)
        yield error_event(internal_error(exc))
    finally:
        await outputs.aclose()
    if done:
        yield "data: [DONE]\n\n"


class StreamUsage:
    """The usage a stream reports (stream_options): none; with include_usage, `usage: null` in every chunk
    and the totals in a last chunk; with continuous_usage_stats too (vLLM's), every chunk counts its
    choice's tokens so far."""

    def __init__(self, options: Any):
        self.final = bool(options and options.include_usage)
        self.continuous = self.final and bool(options.continuous_usage_stats)

    def add_to_chunk(self, body: dict, prompt_tokens: int, output: Any) -> dict:
        """Sets the usage of `body`, a chunk of the choice whose latest engine output is `output` (None before
        its first)."""
        if self.continuous:
            body["usage"] = usage(prompt_tokens, len(output.token_ids) if output is not None else 0)
        elif self.final:
            body["usage"] = None
        return body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json_text(data)}\n\n"
