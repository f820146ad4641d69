"""Reading one streamed OpenAI answer: when each chunk with text came, the usage the server reported and
whether the answer came whole."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx

from radiance.bench import metrics
from radiance.bench.serve_prompts import count_tokens
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def _text_field(where: dict, key: str) -> str:
    value = where.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"stream event {key!r} is not text: {str(value)[:80]}")
    return value or ""


def _first_choice(obj: dict) -> dict | None:
    """The event's choice, None for a usage-only chunk (`choices: []`); any other shape is the server's error."""
    choices = obj.get("choices") or []
    if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
        raise ValueError(f"stream event has a malformed choice: {str(choices)[:80]}")
    return choices[0] if choices else None


def _chunk_text(choice: dict | None, keys: tuple[str, ...] = ("content", "reasoning_content", "reasoning")) -> str:
    """The chunk's generated text under `keys` of a chat delta (a token of reasoning counts as one of content for
    the timings), a completion's `text`."""
    if choice is None:
        return ""
    if "delta" not in choice:
        return _text_field(choice, "text")
    delta = choice["delta"] or {}
    if not isinstance(delta, dict):
        raise ValueError(f"stream event has a malformed delta: {str(delta)[:80]}")
    return "".join(_text_field(delta, key) for key in keys)


def _usage_count(usage: dict, key: str) -> int | None:
    value = usage.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"stream event usage {key!r} is not a count: {str(value)[:80]}")
    return value


def _stream_event(data: str) -> dict:
    """One `data:` payload as a JSON object; anything else (`[1, 2]`, a bare string) is the server's error and
    fails this request only, not the whole run."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"stream event is not a JSON object: {data[:80]}")
    return obj


@dataclass
class Stream:
    """What one streamed answer delivered: when each chunk with text came and the usage the server reported."""

    chunk_times: list[float] = field(default_factory=list)
    # every event with a choice, text or not (a role-only delta, a finish_reason alone): vLLM's benchmark times
    # these, and its end-to-end latency ends at the last of them, not at [DONE] or the usage chunk after it
    choice_times: list[float] = field(default_factory=list)
    chunk_usage: list[int | None] = field(default_factory=list)  # completion_tokens so far, sent with each text chunk
    completion_tokens: int | None = None  # the last usage's
    prompt_tokens: int | None = None
    finished: bool = False  # a finish_reason or [DONE] came: the answer is whole
    events: int = 0  # `data:` lines read
    text: list[str] = field(default_factory=list)  # the generated content: vLLM tokenizes it when no usage came
    text_tokens: int | None = None  # that text's tokens by the server's /tokenize, where no usage came

    def add(self, obj: dict, now: float) -> None:
        choice = _first_choice(obj)
        usage = obj.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise ValueError(f"stream event usage is not an object: {str(usage)[:80]}")
        completion = _usage_count(usage, "completion_tokens") if usage else None
        if choice is not None:
            self.choice_times.append(now)
        if _chunk_text(choice):
            self.chunk_times.append(now)
            self.chunk_usage.append(completion)
            # the content alone, as vLLM's generated_text: servers send reasoning under both of its names
            self.text.append(_chunk_text(choice, ("content",)))
        if choice is not None and choice.get("finish_reason"):
            self.finished = True
        if usage:  # a later usage without a count keeps the earlier one
            self.completion_tokens = completion if completion is not None else self.completion_tokens
            prompt = _usage_count(usage, "prompt_tokens")
            self.prompt_tokens = prompt if prompt is not None else self.prompt_tokens

    def vllm_timings(self, start: float) -> tuple[float, list[float], float]:
        """vLLM's time to first token, inter-token latencies and end-to-end latency: from the send to the first
        event with a choice, one gap per such event after it (whatever it carries), and to the last of them."""
        times = self.choice_times
        return times[0] - start, [b - a for a, b in zip(times, times[1:])], times[-1] - start

    def token_timings(self, start: float) -> tuple[float, list[float], float]:
        """radiance's: to the first text, k gaps of g / k for a chunk of k tokens that came g after the one before
        (metrics.inter_token_latencies), and vLLM's end (the last event with a choice)."""
        ttft = self.chunk_times[0] - start
        return ttft, metrics.inter_token_latencies(self.chunk_times, self.tokens_per_chunk()), \
            self.choice_times[-1] - start

    @property
    def output_tokens(self) -> int:
        """The usage's count, else the text's by /tokenize; at least one a text chunk (each carried a token)."""
        counted = self.completion_tokens if self.completion_tokens is not None else self.text_tokens
        return max(len(self.chunk_times), counted or 0)

    def tokens_per_chunk(self) -> list[int]:
        """The server's counts when every text chunk carried its usage (continuous_usage_stats) and they add up,
        else the total spread evenly over the chunks."""
        if self.chunk_usage and None not in self.chunk_usage:
            counts = [b - a for a, b in zip([0, *self.chunk_usage], self.chunk_usage)]
            if min(counts) >= 1:
                return counts
        return metrics.tokens_per_chunk(self.output_tokens, len(self.chunk_times))


async def read_stream(resp: httpx.Response, stream: Stream) -> str | None:
    """Reads the events into `stream`; returns the error the server streamed, if any."""
    async for line in resp.aiter_lines():
        if line.startswith("error:"):  # llama.cpp's server streams its errors as `error: {...}` lines
            return f"stream error: {line[6:].strip()}"[:200]
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        stream.events += 1
        if data == "[DONE]":
            stream.finished = True
            return None
        obj = _stream_event(data)
        if (error := event_error(obj)) is not None:
            return f"stream error: {error}"[:200]
        stream.add(obj, time.perf_counter())
    return None


def event_error(obj: dict) -> str | None:
    """The error an event (or an error answer's JSON body) carries, as its message: vLLM and SGLang stream
    `{"error": {"message", "type", "code"}}`, older vLLM answers `{"object": "error", "message", ...}`, TGI
    `{"error": "text"}`; None for an ordinary event (an `"error": null` beside the choices too)."""
    error = obj.get("error")
    if error is None and obj.get("object") == "error":
        error = obj
    if error is None:
        return None
    if not isinstance(error, dict):
        return str(error)
    message = error.get("message")
    extra = ", ".join(f"{k} {error[k]}" for k in ("type", "code") if error.get(k) not in (None, ""))
    text = message if isinstance(message, str) and message else json.dumps(error)
    return f"{text} ({extra})" if extra else text


def stream_problem(stream: Stream, vllm_form: bool = False) -> str | None:
    """Why the answer does not count, None when it does. radiance's lines want text and a finish_reason or [DONE];
    a vLLM line (vLLM's request functions, vllm/benchmarks/lib/endpoint_request_func.py) counts a request once any
    event had a choice, text or not: an answer whose first token is EOS (a role chunk, then the finish) is a
    successful one-token request there, its tokens the usage's."""
    if not stream.events:  # e.g. one JSON answer from a server that ignores "stream": true
        return "the response is not an event stream (no `data:` lines)"
    if vllm_form:
        return None if stream.choice_times else "no event with a choice streamed (vLLM fails such a request too)"
    if not stream.chunk_times:
        return "no tokens streamed"
    if not stream.finished:  # the connection closed mid-answer: its numbers would flatter the server
        return f"stream ended after {len(stream.chunk_times)} chunk(s) without a finish_reason or [DONE]"
    return None


def http_error(status: int, body: str) -> str:
    """An error answer as `HTTP 500: its message`, a JSON error reduced to its message, type and code."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    message = event_error(obj) if isinstance(obj, dict) else None
    return f"HTTP {status}: {' '.join((message or body).split())[:200]}"


async def tokenize_texts(client: httpx.AsyncClient, model: str, streams: list[Stream]) -> None:
    """Sets each stream's text_tokens: vLLM counts a request whose server streamed no usage by tokenizing its
    generated text without special tokens (calculate_metrics), here with the server's /tokenize. A server without
    it (or one that fails) leaves them None, the chunks' count standing."""
    texts = ["".join(stream.text) for stream in streams]
    try:
        counts = [await count_tokens(client, model, texts[0])] if texts else []  # one first: a missing /tokenize
        counts += await asyncio.gather(*(count_tokens(client, model, text) for text in texts[1:]))
    except (ConfigError, httpx.HTTPError) as exc:
        logger.warning("no usage came and the server's /tokenize did not count the text (%s): output tokens are "
                       "counted as streamed chunks", str(exc)[:160])
        return
    for stream, count in zip(streams, counts):
        stream.text_tokens = count
