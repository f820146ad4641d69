"""Randomized churn of the HTTP server in front of a real engine (the tiny random Llama 3 with its byte-level BPE
tokenizer, fp32 on the CPU, behind AsyncLLMEngine and uvicorn in a thread), as tests/engine/test_engine_churn.py
churns the engine. Each seed takes a profile (PROFILES: a KV cache tight enough to preempt, chunked prefill with
overlapped decode, n-gram speculation without prefix caching, a 128-token context, a chat template that opens a
<think> block; the /metrics names with radiance_ or vLLM's vllm:), then sends, in bursts, a mix of:

- /v1/chat/completions and /v1/completions (text, token ids, several prompts), streamed or not, n > 1,
  logprobs / top_logprobs, prompt_logprobs, echo (a completion's prompt, a continued assistant message), stop
  strings, small max_tokens or none (up to the context), min_tokens, truncate_prompt_tokens, response_format
  json_schema / json_object, structured_outputs (json, regex, choice), tools (hermes markup) with tool_choice
  auto / required / named / none, bad_words, allowed_token_ids, seeded sampling, stream_options usage;
- /v1/responses chains (previous_response_id, truncation auto in a short context) read back with GET and paged
  input_items, DELETEd sometimes (after it: a 404, and a 400 for a follow-up naming it); peeked at while they
  stream (in progress: a follow-up naming one is refused), DELETEd while they stream;
- /tokenize, /detokenize, /invocations (chat and completion bodies), /metrics, /health, /v1/models;
- clients that leave: a stream closed after k events, a non-streaming request cancelled after a while;
- malformed bodies (tests/server/malformed.py's catalogue) and requests over the context.

What must hold whatever the mix:

- a well-formed request gets a 200 in OpenAI's shape, whose choices are the engine requests it made (the engine
  is wrapped to record each one's prompt and final output): their text (reasoning + content with the think
  template), finish and stop reasons, usage (prompt, completion and cached tokens; per chunk with
  continuous_usage_stats), a logprob per token where no token was cut from the text, text offsets, forced tool
  calls, constrained outputs that parse; a stream starts each choice with the role, ends with [DONE] and has
  no error event; a malformed request gets its OpenAI-shaped 4xx (never a 500);
- a greedy or seeded request answers what the same request answers served alone (replayed afterwards, not
  streamed: streaming and batching change nothing), and a chat's prompt is the count /tokenize gives its messages;
- afterwards the server still serves, the engine is idle (no sequence, no queued request, no KV block in use
  but the prefix cache's evictable ones), no stored response is left in progress (one whose client left is
  stored cancelled, one deleted mid-stream stays deleted), and /metrics parses and adds up: request_success per
  finish reason totals the engine requests that ended (abort: theirs, and at most those of clients that left),
  request_errors the 4xx answers sent (499: at most one per client that left, nothing else), the prompt /
  generation token counters the engine requests' tokens, the per-request histograms' counts one per engine
  request, the per-prompt ones (request_params_n, max_num_generation_tokens) one per prompt.

What the churn found is kept at the end as focused repros (fixed since): logprobs lost after a token without text
of its own (EOS let through by ignore_eos), and lone UTF-16 surrogates echoed into an answer that could not be
encoded (a 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import time
from dataclasses import dataclass

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from radiance.config import ServerConfig
from radiance.engine.async_engine import AsyncLLMEngine
from radiance.server.api import build_app
from radiance.server.state import ServerState
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer, tiny_hf_model
from tests.server.fake_engine import serve_in_thread
from tests.server.malformed import MALFORMED, body_bytes, check_error_shape

MODEL = "fake"
# hermes tool markup (<tool_call>), so the tool-call parser and the forced-call grammars are the hermes ones
TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content if m.content else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# the same opening a <think> block for the answer unless enable_thinking is false (Qwen3's way): the think
# reasoning parser, and constraints held after the reasoning
THINK_TEMPLATE = TEMPLATE.replace("<|assistant|>{% endif %}",
                                  "<|assistant|>{% if enable_thinking is not defined or enable_thinking %}<think>"
                                  "{% endif %}{% endif %}")
WORDS = ("the quick brown fox jumps over lazy dog Paris is capital of France and Rome Italy name age city "
         "The Ann").split()
TEXT_TOKENS = 300  # the tiny tokenizer's tokens (0 is <eos>); the model's vocabulary has a few more rows
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = "[a-z]{1,5}( [a-z]{1,5}){0,3}"
CHOICES = ["Paris", "Rome", "the capital of France"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]
FLAT_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
              for t in TOOLS]
CHAT_REASONS = {"stop", "length", "tool_calls"}
STICKY = (276, 244, 224, 113, 32)  # tokens the tiny model answers (greedy) with a run of one token


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine two OpenMP threads waiting for each other made each step of
    the tiny model ~25x slower (tests/engine/test_engine_churn.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The tiny random Llama 3 with a real byte-level BPE tokenizer (tests/engine/conftest.py's tiny_text_llm)."""
    path = tmp_path_factory.mktemp("llama3-text-server")
    tokenizer = tiny_byte_bpe_tokenizer()
    model = tiny_hf_model("llama3", seed=1, vocab_size=TINY_TOKENIZER_VOCAB)
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id = None, tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_engine(path: str, **options):
    from radiance import LLM

    return LLM(path, device="cpu", dtype="float32", **options).engine


# ---------------------------------------------------------------- the engine, recorded


class Recorded:
    """Wraps an LLMEngine's add_request and step (on the instance): each engine request's prompt length and its
    final output (finished, or the abort's), as the engine saw them."""

    def __init__(self, engine):
        self.engine = engine
        self.prompts: dict[str, int] = {}  # request id -> prompt tokens
        self.finals: dict[str, object] = {}  # request id -> its last StepOutput (finished)
        add, step = engine.add_request, engine.step

        def add_request(request_id, prompt_token_ids, params=None):
            add(request_id, prompt_token_ids, params)
            self.prompts[request_id] = len(prompt_token_ids)

        def recorded_step():
            outputs = step()
            for out in outputs:
                if out.finished:
                    assert out.request_id not in self.finals, f"{out.request_id} ended twice"
                    self.finals[out.request_id] = out
            return outputs

        engine.add_request, engine.step = add_request, recorded_step

    def of(self, response_id: str) -> dict[int, object]:
        """Choice index -> final output of the engine requests of one response (`<id>-<index>-<hex>`)."""
        out = {}
        for rid, final in self.finals.items():
            head, index, _ = rid.rsplit("-", 2)
            if head == response_id:
                assert int(index) not in out
                out[int(index)] = final
        return out


@contextlib.contextmanager
def serve(engine, prefix: str = "radiance_", template: str = TEMPLATE, **config):
    """uvicorn in a thread in front of AsyncLLMEngine(engine); yields (base URL, ServerState, AsyncLLMEngine)."""
    async_engine = AsyncLLMEngine(engine=engine)
    state = ServerState(ServerConfig(served_model_name=(MODEL,), chat_template=template, metrics_prefix=prefix,
                                     max_n=4, **config), engine_factory=lambda: async_engine)
    state.attach(async_engine)
    with serve_in_thread(build_app(state)) as url:
        yield url, state, async_engine


# ---------------------------------------------------------------- scenarios


@dataclass
class Call:
    """One HTTP request of a scenario and what came back."""

    tag: str  # X-Request-Id: the body's id is `<prefix>-<tag>`, the engine requests' `<prefix>-<tag>-<i>-<hex>`
    kind: str  # chat, completion, responses, tokenize, detokenize, malformed:<name>, too long
    method: str
    path: str
    body: object  # dict, or raw bytes
    delay: float = 0.0  # seconds after the start it is sent
    leave_after: int | None = None  # stream: the client closes it after this many events
    cancel_after: float | None = None  # not streamed: the client gives up after this many seconds
    expect: tuple[int, str | None] | None = None  # an error's (status, param)
    prompts: int = 1  # prompts of a completion (each has n engine requests)
    status: int | None = None
    answer: object = None  # the parsed body, or the stream's events
    left: bool = False  # the client left before the end
    response_id: str | None = None  # a /v1/responses id
    deleted: bool = False  # a response DELETEd while it streamed

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return self.body.get("n", 1) if isinstance(self.body, dict) else 1

    @property
    def deterministic(self) -> bool:
        body = self.body
        return isinstance(body, dict) and (body.get("temperature") == 0 or body.get("seed") is not None)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _sampling(rng: random.Random, body: dict, chat: bool) -> None:
    """Greedy mostly, seeded sampling sometimes, unseeded rarely; the options that end or shape an output."""
    roll = rng.random()
    if roll < 0.75 and body.get("n", 1) == 1:
        body["temperature"] = 0
    elif roll < 0.92:  # n > 1 samples with a seed: greedy choices are refused (a 400), as vLLM refuses them
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 20), top_k=rng.choice([-1, 20]))
    if rng.random() < 0.7:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        body["stop"] = rng.sample(["e", "a", "th", " ", "o", "\n", "s"], rng.randint(1, 2))
        if rng.random() < 0.3:
            body["include_stop_str_in_output"] = True
    if rng.random() < 0.1:
        body["bad_words"] = rng.sample(["the", "fox", "Paris", "a"], rng.randint(1, 2))
    if rng.random() < 0.1:
        body["allowed_token_ids"] = rng.sample(range(1, TEXT_TOKENS), 40)
    if rng.random() < 0.08:
        limit = body.get("max_tokens", body.get("max_completion_tokens")) or 4
        body["min_tokens"] = rng.randint(1, min(4, limit))
    if rng.random() < 0.08:
        body["frequency_penalty"] = 0.5
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 1, 3])
        else:
            body["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.15:
        body["structured_outputs"] = rng.choice([{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}])
    elif rng.random() < 0.1:
        body["response_format"] = rng.choice([{"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                                              {"type": "json_object"}])


def _streaming(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.45:
        body["stream"] = True
        if rng.random() < 0.6:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.4}
    elif rng.random() < 0.08:
        body["prompt_logprobs"] = rng.choice([0, 2])  # vLLM's; not with stream


def chat_body(rng: random.Random, max_model_len: int, think: bool) -> dict:
    short = max_model_len <= 256  # prompts and outputs that fit a short context
    messages = [{"role": "user", "content": _text(rng, 1, 5 if short else 12)}]
    if rng.random() < 0.2 and not short:
        messages.insert(0, {"role": "system", "content": _text(rng, 1, 6)})
    if rng.random() < 0.2 and not short:
        messages[-1:-1] = [{"role": "user", "content": _text(rng, 1, 4)},
                           {"role": "assistant", "content": _text(rng, 1, 4)}]
    body: dict = {"model": MODEL, "messages": messages}
    roll = rng.random()
    if roll < 0.75:
        body[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.randint(1, 16)
    elif roll < 0.85 and short:
        pass  # up to the context
    else:
        body["max_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    _sampling(rng, body, chat=True)
    if rng.random() < 0.2 and "structured_outputs" not in body and "response_format" not in body:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, 2))
        choice = rng.choice(["required", "named", "auto", "none", None])
        if choice == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": body["tools"][0]["function"]["name"]}}
        elif choice is not None:
            body["tool_choice"] = choice
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = False
        for key in ("stop", "bad_words", "allowed_token_ids"):  # they would cut or bend a call's markup
            body.pop(key, None)
    elif rng.random() < 0.08 and not think:  # the model continues the assistant's message, echoed first
        messages.append({"role": "assistant", "content": _text(rng, 1, 3)})
        body.update(add_generation_prompt=False, continue_final_message=True, echo=rng.random() < 0.7)
    if think and rng.random() < 0.3:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    _streaming(rng, body)
    return body


def completion_body(rng: random.Random, prompts: list) -> tuple[dict, int]:
    roll = rng.random()
    if roll < 0.1:  # a run the tiny model answers with a run: n-gram drafts it keeps
        prompt, count = [rng.choice(STICKY)] * rng.randint(3, 12), 1
    elif roll < 0.35:
        prompt, count = _text(rng, 1, 12), 1
    elif roll < 0.55:
        prompt, count = rng.choice(prompts), 1  # shared: prefix-cache hits
    elif roll < 0.8:
        prompt, count = [rng.randrange(1, TEXT_TOKENS) for _ in range(rng.randint(1, 24))], 1
    else:
        count = rng.randint(2, 3)
        prompt = [rng.choice([_text(rng, 1, 6), rng.choice(prompts)]) for _ in range(count)]
        if rng.random() < 0.5:
            prompt = [[rng.randrange(1, TEXT_TOKENS) for _ in range(rng.randint(1, 12))] for _ in range(count)]
    body: dict = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 16)}
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.1:
        body["echo"] = True
    if rng.random() < 0.08:
        body["truncate_prompt_tokens"] = rng.randint(1, 8)
    _sampling(rng, body, chat=False)
    _streaming(rng, body)
    return body, count


def responses_body(rng: random.Random, max_model_len: int) -> dict:
    body: dict = {"model": MODEL, "max_output_tokens": rng.randint(1, 16), "temperature": 0}
    if max_model_len <= 256:  # a chain outgrows a short context: its oldest turns are dropped
        body["truncation"] = "auto"
    words = 3 if max_model_len <= 160 else 8  # the newest input, the instructions and tools always fit
    if rng.random() < 0.5:
        body["input"] = _text(rng, 1, words)
    else:
        body["input"] = [{"type": "message", "role": "user", "content": _text(rng, 1, words)}]
    if rng.random() < 0.3:
        body["instructions"] = _text(rng, 1, words // 2 + 1)
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    roll = rng.random()
    if roll < 0.15:
        body["text"] = {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}
    elif roll < 0.3:
        body["tools"] = FLAT_TOOLS
        body["tool_choice"] = rng.choice(["required", "auto", {"type": "function", "name": "add"}])
    if rng.random() < 0.2:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.5:
        body["stream"] = True
    return body


def malformed_call(rng: random.Random, tag: str, max_model_len: int, delay: float) -> Call:
    name, method, path, body, status, param = rng.choice(MALFORMED)
    raw = None if body is None else body_bytes(body, MODEL, max_model_len + 1)
    return Call(tag, "malformed:" + name, method, path, raw, delay, expect=(status, param))


def too_long_call(rng: random.Random, tag: str, max_model_len: int, delay: float) -> Call:
    roll = rng.random()
    if roll < 0.3:
        prompt = [rng.randrange(1, TEXT_TOKENS) for _ in range(max_model_len + rng.randint(0, 9))]
        return Call(tag, "too long", "POST", "/v1/completions", {"model": MODEL, "prompt": prompt}, delay,
                    expect=(400, "prompt"))
    if roll < 0.55:
        body = {"model": MODEL, "prompt": _text(rng, 1, 4), "max_tokens": max_model_len, "stream": rng.random() < 0.5}
        return Call(tag, "too long", "POST", "/v1/completions", body, delay, expect=(400, "max_tokens"))
    if roll < 0.8:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Paris " * max_model_len}], "max_tokens": 4}
        return Call(tag, "too long", "POST", "/v1/chat/completions", body, delay, expect=(400, "messages"))
    body = {"model": MODEL, "input": "Rome " * max_model_len, "stream": rng.random() < 0.5}
    return Call(tag, "too long", "POST", "/v1/responses", body, delay, expect=(400, "input"))


@dataclass
class Step:
    """One response of a /v1/responses chain."""

    body: dict
    leave: bool = False  # the client leaves its stream mid-way (the chain ends there)
    delete: bool = False  # DELETE it once answered (the chain goes on from the one before)
    peek: bool = False  # while it streams: GET it (in progress) and name it in a follow-up (refused meanwhile)
    delete_early: bool = False  # ... and DELETE it then: it stays deleted once answered


def scenario(rng: random.Random, num_calls: int, max_model_len: int, think: bool) -> tuple[list[Call], list]:
    """The independent calls, and the /v1/responses chains (each a list of Steps run in order)."""
    shared = [_text(rng, 4, 10) for _ in range(3)]
    calls: list[Call] = []
    for i in range(num_calls):
        # in bursts, so that requests meet in the engine (and a tight KV cache preempts)
        tag, delay, roll = f"t{i}", rng.choice([0.0, 0.4, 0.8, 1.2]) + rng.random() * 0.1, rng.random()
        if roll < 0.3:
            call = Call(tag, "chat", "POST", "/v1/chat/completions", chat_body(rng, max_model_len, think), delay)
        elif roll < 0.58:
            body, count = completion_body(rng, shared)
            call = Call(tag, "completion", "POST", "/v1/completions", body, delay, prompts=count)
        elif roll < 0.64:
            if rng.random() < 0.5:
                call = Call(tag, "chat", "POST", "/invocations", chat_body(rng, max_model_len, think), delay)
            else:
                body, count = completion_body(rng, shared)
                call = Call(tag, "completion", "POST", "/invocations", body, delay, prompts=count)
        elif roll < 0.7:
            call = Call(tag, "tokenize", "POST", "/tokenize", {"prompt": _text(rng, 1, 10)}, delay)
        elif roll < 0.72:
            ids = [rng.randrange(1, TEXT_TOKENS) for _ in range(rng.randint(1, 10))]
            call = Call(tag, "detokenize", "POST", "/detokenize", {"tokens": ids}, delay)
        elif roll < 0.74:  # the operator's routes meanwhile
            call = Call(tag, "side", "GET", rng.choice(["/metrics", "/health", "/v1/models", "/version"]), None, delay)
        elif roll < 0.86:
            call = malformed_call(rng, tag, max_model_len, delay)
        else:
            call = too_long_call(rng, tag, max_model_len, delay)
        if call.kind in ("chat", "completion") and rng.random() < 0.2:  # a client that leaves, mid-way
            call.body.update(max_tokens=48 if max_model_len > 160 else 20, ignore_eos=True)
            for key in ("max_completion_tokens", "min_tokens", "prompt_logprobs"):
                call.body.pop(key, None)
            if call.stream:
                call.leave_after = rng.randint(1, 8)
            else:
                call.cancel_after = rng.uniform(0.005, 0.1)
        calls.append(call)
    chains = []
    for _ in range(rng.randint(1, 3)):
        steps = [Step(responses_body(rng, max_model_len), delete=rng.random() < 0.25) for _ in range(rng.randint(1, 3))]
        for step in steps:
            if step.body.get("stream") and rng.random() < 0.3:
                step.peek, step.delete_early = True, rng.random() < 0.3
                step.body.update(max_output_tokens=24, ignore_eos=True)  # long enough to be seen in progress
        if steps[-1].body.get("stream") and rng.random() < 0.25:
            steps[-1].leave = True
            steps[-1].body.update(max_output_tokens=24, ignore_eos=True)
        chains.append(steps)
    return calls, chains


# ---------------------------------------------------------------- sending


def sse_events(lines: list[str]) -> list:
    """The data of a stream's events: parsed JSON, or "[DONE]"."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def send(client: httpx.AsyncClient, call: Call, start: float, on_event=None) -> None:
    """Sends `call` at its time; a stream's events (each handed to `on_event` as it comes) or the body in answer."""
    await asyncio.sleep(max(0.0, start + call.delay - time.monotonic()))
    headers = {"x-request-id": call.tag}
    kwargs: dict = dict(headers=headers)
    if isinstance(call.body, bytes):
        kwargs["content"] = call.body
        headers["content-type"] = "application/json"
    elif call.body is not None:
        kwargs["json"] = call.body
    if call.stream:
        lines: list[str] = []
        async with client.stream(call.method, call.path, **kwargs) as r:
            call.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                call.answer = r.json()
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if on_event is not None:
                        await on_event(sse_events([line])[0])
                    if call.leave_after is not None and len(lines) >= call.leave_after:
                        call.left = True
                        break
        call.answer = sse_events(lines)
        if call.left and call.answer and call.answer[-1] == "[DONE]":
            call.left = False  # it had ended already
        if call.kind == "responses" and call.answer and isinstance(call.answer[0], dict):
            call.response_id = call.answer[0].get("response", {}).get("id")
        return
    request = client.request(call.method, call.path, **kwargs)
    try:
        r = await (asyncio.wait_for(request, call.cancel_after) if call.cancel_after else request)
    except asyncio.TimeoutError:
        call.left = True
        return
    call.status = r.status_code
    call.answer = r.text if call.path == "/metrics" else r.json() if r.content else None


# ---------------------------------------------------------------- checks of each answer


def check_error(call: Call) -> None:
    status, param = call.expect
    check_error_shape(httpx.Response(call.status, json=call.answer), status, param)


def _add_logprobs(choice: dict, entries: list | None) -> None:
    if entries is not None:
        choice["logprobs"] = (choice["logprobs"] or []) + entries


def chat_choices(call: Call) -> tuple[dict[int, dict], dict | None]:
    """index -> {content, reasoning, tool_calls [(name, arguments)], finish_reason, logprobs [(token, logprob)],
    usages (a stream's per-chunk usage)}, and the usage, of a chat answer whole or streamed."""
    out: dict[int, dict] = {}
    if not call.stream:
        body = call.answer
        assert body["object"] == "chat.completion" and body["id"] == f"chatcmpl-{call.tag}" and body["model"] == MODEL
        for c in body["choices"]:
            message = c["message"]
            assert message["role"] == "assistant"
            assert message.get("reasoning_content") == message.get("reasoning")
            out[c["index"]] = dict(
                content=message["content"] or "", reasoning=message.get("reasoning_content") or "",
                tool_calls=[(t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls", [])],
                finish_reason=c["finish_reason"], stop_reason=c["stop_reason"], usages=[],
                logprobs=None if c["logprobs"] is None else [(t["token"], t["logprob"]) for t in c["logprobs"]["content"]])
        return out, body["usage"]
    events = call.answer
    assert events[-1] == "[DONE]", events[-3:]
    usage = None
    for event in events[:-1]:
        assert "error" not in event, event
        assert event["object"] == "chat.completion.chunk" and event["id"] == f"chatcmpl-{call.tag}"
        if not event["choices"]:
            assert usage is None
            usage = event["usage"]
            continue
        [c] = event["choices"]
        delta = c["delta"]
        if c["index"] not in out:  # each choice starts with the assistant's role
            assert delta == {"role": "assistant", "content": ""}, (call.tag, delta)
        choice = out.setdefault(c["index"], dict(content="", reasoning="", tool_calls=[], finish_reason=None,
                                                 stop_reason=None, logprobs=None, usages=[]))
        assert choice["finish_reason"] is None, f"{call.tag}: a chunk after the finish"
        for t in delta.get("tool_calls", []):  # a call comes whole, numbered in order
            assert t["id"] and t["type"] == "function" and t["index"] == len(choice["tool_calls"]), (call.tag, t)
            choice["tool_calls"].append((t["function"]["name"], t["function"]["arguments"]))
        choice["content"] += delta.get("content") or ""
        choice["reasoning"] += delta.get("reasoning_content") or ""
        assert delta.get("reasoning_content") == delta.get("reasoning")
        _add_logprobs(choice, None if c["logprobs"] is None else [(t["token"], t["logprob"])
                                                                  for t in c["logprobs"]["content"]])
        choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c["stop_reason"]
        choice["usages"].append(event.get("usage", "absent"))
    if call.body.get("logprobs"):
        for choice in out.values():
            choice["logprobs"] = choice["logprobs"] or []
    return out, usage


def completion_choices(call: Call) -> tuple[dict[int, dict], dict | None]:
    out: dict[int, dict] = {}
    if not call.stream:
        body = call.answer
        assert body["object"] == "text_completion" and body["id"] == f"cmpl-{call.tag}" and body["model"] == MODEL
        for c in body["choices"]:
            lp = c["logprobs"]
            out[c["index"]] = dict(text=c["text"], finish_reason=c["finish_reason"], stop_reason=c["stop_reason"],
                                   usages=[], offsets=lp and lp["text_offset"],
                                   logprobs=None if lp is None else list(zip(lp["tokens"], lp["token_logprobs"])),
                                   prompt_logprobs=c.get("prompt_logprobs"))
        return out, body["usage"]
    events = call.answer
    assert events[-1] == "[DONE]", events[-3:]
    usage = None
    for event in events[:-1]:
        assert "error" not in event, event
        assert event["object"] == "text_completion" and event["id"] == f"cmpl-{call.tag}"
        if not event["choices"]:
            assert usage is None
            usage = event["usage"]
            continue
        [c] = event["choices"]
        choice = out.setdefault(c["index"], dict(text="", finish_reason=None, stop_reason=None, logprobs=None,
                                                 offsets=None, usages=[]))
        assert choice["finish_reason"] is None, f"{call.tag}: a chunk after the finish"
        choice["text"] += c["text"]
        lp = c["logprobs"]
        _add_logprobs(choice, None if lp is None else list(zip(lp["tokens"], lp["token_logprobs"])))
        if lp is not None:
            choice["offsets"] = (choice["offsets"] or []) + lp["text_offset"]
        choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c["stop_reason"]
        choice["usages"].append(event.get("usage", "absent"))
    if call.body.get("logprobs") is not None:
        for choice in out.values():
            choice["logprobs"], choice["offsets"] = choice["logprobs"] or [], choice["offsets"] or []
    return out, usage


def check_stream_usage(call: Call, choices: dict[int, dict], finals: dict[int, object]) -> None:
    """stream_options: no usage in chunks without include_usage; null with it; with continuous_usage_stats each
    chunk's counts its choice's tokens so far (the prompt's, the output's), the last one the final output's."""
    options = call.body.get("stream_options") or {}
    for index, choice in choices.items():
        usages = choice["usages"]
        if not options.get("include_usage"):
            assert set(map(str, usages)) == {"absent"}, usages
        elif not options.get("continuous_usage_stats"):
            assert all(u is None for u in usages), usages
        else:
            final = finals[index]
            counts = [u["completion_tokens"] for u in usages]
            assert counts == sorted(counts) and counts[-1] == len(final.token_ids), (call.tag, counts)
            assert all(u["prompt_tokens"] == len(final.prompt_token_ids) for u in usages)
            assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def check_generation(call: Call, engine: Recorded, think: bool) -> dict[int, dict]:
    """A chat or completion answer: its choices are its engine requests' (one per prompt and choice, each ended
    once), their text and finish reason the engine's, its usage their tokens."""
    assert call.status == 200, (call.tag, call.status, call.answer)
    chat = call.kind == "chat"
    choices, usage = chat_choices(call) if chat else completion_choices(call)
    finals = engine.of(f"{'chatcmpl' if chat else 'cmpl'}-{call.tag}")
    total = call.n * call.prompts
    assert sorted(choices) == list(range(total)) == sorted(finals), (call.tag, sorted(choices), sorted(finals))
    body = call.body
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    tokenizer = engine.engine.tokenizer
    for index, choice in choices.items():
        final = finals[index]
        reason = choice["finish_reason"]
        assert final.finish_reason in ("stop", "length"), (call.tag, final.finish_reason)
        if chat:
            assert reason in CHAT_REASONS, (call.tag, reason)
            if reason == "tool_calls":
                assert final.finish_reason == "stop" and choice["tool_calls"]
            else:
                assert reason == final.finish_reason, (call.tag, reason, final.finish_reason)
            if not body.get("tools") or body.get("tool_choice") == "none":
                echoed = body["messages"][-1]["content"] if body.get("echo") else ""
                assert not choice["tool_calls"]
                if think:  # the reasoning parser takes the <think> block apart (and the spaces that start a part)
                    assert (choice["reasoning"] + choice["content"]).split() == final.text.split(), (call.tag, choice)
                else:
                    assert choice["content"] == echoed + final.text, (call.tag, index, choice["content"], final.text)
                    assert not choice["reasoning"]
        else:
            assert reason == final.finish_reason, (call.tag, reason, final.finish_reason)
            echoed = ""
            if body.get("echo"):
                prompt = body["prompt"] if call.prompts == 1 else body["prompt"][index // call.n]
                echoed = prompt if isinstance(prompt, str) and "truncate_prompt_tokens" not in body \
                    else tokenizer.decode(final.prompt_token_ids)
            assert choice["text"] == echoed + final.text, (call.tag, index, choice["text"], final.text)
            if body.get("prompt_logprobs") is not None:
                lp = choice["prompt_logprobs"]
                assert lp[0] is None and len(lp) == len(final.prompt_token_ids)
                assert all(str(t) in entry for t, entry in zip(final.prompt_token_ids[1:], lp[1:]))
        assert choice["stop_reason"] == final.stop_reason, (call.tag, choice["stop_reason"], final.stop_reason)
        tokens = len(final.token_ids)
        assert tokens >= 1
        if limit is not None:
            assert tokens <= limit
            if reason == "length":
                assert tokens == limit or len(final.prompt_token_ids) + tokens == engine.engine.max_model_len
        elif reason == "length":  # no limit: the context's
            assert len(final.prompt_token_ids) + tokens == engine.engine.max_model_len
        if "truncate_prompt_tokens" in body:
            assert len(final.prompt_token_ids) <= body["truncate_prompt_tokens"]
        if choice["logprobs"] is not None and not body.get("echo"):  # echo: the prompt's come first
            assert len(choice["logprobs"]) <= tokens
            # every token's when nothing was cut from the text; offsets where every token has a text of its own
            clean = all("\ufffd" not in tokenizer.decode([t], skip_special_tokens=True) != "" for t in final.token_ids)
            if final.finish_reason == "length" and not body.get("stop"):
                assert len(choice["logprobs"]) == tokens, (call.tag, index, len(choice["logprobs"]), tokens, body, final)
            if not chat and clean and not body.get("stop"):  # each token's text where it starts in the text
                offsets, text = choice["offsets"], choice["text"]
                ends = offsets[1:] + [len(text)]
                assert [text[a:b] for a, b in zip(offsets, ends)] == [t for t, _ in choice["logprobs"]], (call.tag, choice)
        spec = body.get("structured_outputs") or {}
        # (a constraint that allowed_token_ids or bad_words leave no token to go on with ends the output there)
        if reason == "stop" and not think and not any(body.get(k) for k in ("stop", "allowed_token_ids", "bad_words")):
            if spec.get("choice"):
                assert final.text in CHOICES, final.text
            elif "json" in spec or (body.get("response_format") or {}).get("type") in ("json_schema", "json_object"):
                assert is_json(final.text), (call.tag, body, final)
            elif spec.get("regex"):
                assert re.fullmatch(REGEX, final.text), (call.tag, final.text)
    prompt_tokens = sum(len(finals[p * call.n].prompt_token_ids) for p in range(call.prompts))
    # cached prompt tokens: once per prompt, the most any of its choices found
    cached = sum(max(finals[p * call.n + i].num_cached_tokens for i in range(call.n)) for p in range(call.prompts))
    if usage is not None:
        assert usage["prompt_tokens"] == prompt_tokens, (call.tag, usage, prompt_tokens)
        assert usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) == cached, (call.tag, usage, cached)
        assert usage["completion_tokens"] == sum(len(f.token_ids) for f in finals.values()), (call.tag, usage)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        assert call.stream and not (body.get("stream_options") or {}).get("include_usage")
    if call.stream:
        check_stream_usage(call, choices, finals)
    return choices


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def check_tool_calls(call: Call, choices: dict[int, dict]) -> None:
    """Calls name the tools offered, parse as JSON unless cut by max_tokens, and come when forced (finish_reason
    tool_calls, or stop for a named function, as OpenAI's)."""
    body = call.body
    choice = body.get("tool_choice")
    if not body.get("tools") or choice == "none":
        return
    names = {t["function"]["name"] for t in body["tools"]}
    for c in choices.values():
        for name, arguments in c["tool_calls"]:
            assert name in names
            if c["finish_reason"] != "length":
                assert is_json(arguments), (call.tag, arguments)
        if isinstance(choice, dict):
            assert all(name == choice["function"]["name"] for name, _ in c["tool_calls"])
        if (choice == "required" or isinstance(choice, dict)) and c["finish_reason"] != "length":
            assert c["tool_calls"], (call.tag, c)
            assert c["finish_reason"] == ("stop" if isinstance(choice, dict) else "tool_calls"), (call.tag, c)
        if body.get("parallel_tool_calls") is False:
            assert len(c["tool_calls"]) <= 1


# ---------------------------------------------------------------- /v1/responses


def response_of(call: Call) -> dict:
    """The response object an answer ends with (streamed: its last event's), its events checked."""
    if not call.stream:
        return call.answer
    events = call.answer
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    final = events[-1]["response"]
    texts: dict[str, str] = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e["item_id"]] = texts.get(e["item_id"], "") + e["delta"]
    for item in final["output"]:
        if item["type"] in ("message", "reasoning"):
            assert texts.get(item["id"], "") == item["content"][0]["text"]
    return final


def check_response(call: Call, engine: Recorded, think: bool) -> dict:
    assert call.status == 200, (call.tag, call.status, call.answer)
    body = response_of(call)
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == MODEL
    call.response_id = body["id"]
    [final] = engine.of(body["id"]).values()
    usage = body["usage"]
    assert usage["input_tokens"] == len(final.prompt_token_ids)
    assert usage["output_tokens"] == len(final.token_ids)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] == final.num_cached_tokens
    truncated = final.finish_reason == "length"
    assert body["status"] == ("incomplete" if truncated else "completed"), (body["status"], final.finish_reason)
    assert body["incomplete_details"] == ({"reason": "max_output_tokens"} if truncated else None)
    texts = {kind: "".join(part["text"] for item in body["output"] if item["type"] == kind for part in item["content"])
             for kind in ("message", "reasoning")}
    if not call.body.get("tools"):
        if think:
            assert (texts["reasoning"] + texts["message"]).split() == final.text.split()
        else:
            assert texts["message"] == final.text and not texts["reasoning"]
    return body


async def check_input_items(client: httpx.AsyncClient, response_id: str) -> list[str]:
    """input_items: pages (asc, desc, after an id) that add up to the whole list; its ids."""
    whole = (await client.get(f"/v1/responses/{response_id}/input_items", params={"order": "asc", "limit": 100}))
    assert whole.status_code == 200, whole.text
    items = whole.json()["data"]
    assert items and whole.json()["object"] == "list" and not whole.json()["has_more"]
    ids = [item["id"] for item in items]
    assert len(set(ids)) == len(ids)
    desc = (await client.get(f"/v1/responses/{response_id}/input_items")).json()
    assert [item["id"] for item in desc["data"]] == ids[::-1][:20]
    paged, after = [], None
    while True:
        params = {"order": "asc", "limit": 2} | ({"after": after} if after else {})
        page = (await client.get(f"/v1/responses/{response_id}/input_items", params=params)).json()
        paged += [item["id"] for item in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert paged == ids
    return ids


async def run_chain(client: httpx.AsyncClient, steps: list[Step], tag: str, start: float, delay: float,
                    calls: list[Call], statuses: list[int]) -> None:
    """A chain of responses, each following the last one kept (previous_response_id), each read back (GET,
    input_items); a DELETE sometimes (then its GET is a 404, a follow-up naming it a 400), a peek while one
    streams (in progress: a follow-up naming it is a 400), a client that leaves a stream."""
    await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
    previous, context = None, []  # the response followed, and the input items it brings (its own and its output)
    for i, step in enumerate(steps):
        body = dict(step.body)
        if previous is not None:
            body["previous_response_id"] = previous
        call = Call(f"{tag}s{i}", "responses", "POST", "/v1/responses", body, leave_after=6 if step.leave else None)
        peeked = []

        async def peek(event):
            if not step.peek or peeked or event.get("type") != "response.created":
                return
            response_id = event["response"]["id"]
            got = await client.get(f"/v1/responses/{response_id}")
            assert got.status_code == 200 and got.json()["status"] in ("in_progress", "completed", "incomplete")
            follow = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 1,
                                                              "previous_response_id": response_id})
            peeked.append((got.json()["status"], follow))
            if step.delete_early:
                deleted = await client.delete(f"/v1/responses/{response_id}")
                assert deleted.status_code == 200 and deleted.json()["deleted"] is True
                call.deleted = True

        await send(client, call, time.monotonic(), on_event=peek)
        calls.append(call)
        for status, follow in peeked:  # the follow-up was refused while the response was in progress
            if status == "in_progress":
                check_error_shape(follow, 400, "previous_response_id")
                statuses.append(400)
            else:
                assert follow.status_code in (200, 400), follow.text
                if follow.status_code == 400:
                    statuses.append(400)
        if call.left or call.status != 200:
            return
        response_id = (call.answer if not call.stream else call.answer[-1]["response"])["id"]
        if peeked and step.delete_early:  # deleted while it streamed: not stored again at its end
            check_error_shape(await client.get(f"/v1/responses/{response_id}"), 404, None)
            statuses.append(404)
            continue
        got = await client.get(f"/v1/responses/{response_id}")
        assert got.status_code == 200 and got.json()["id"] == response_id
        assert got.json()["status"] in ("completed", "incomplete"), got.json()["status"]
        assert got.json()["output"] == response_of(call)["output"]
        items = await check_input_items(client, response_id)
        inputs = 1 if isinstance(body["input"], str) else len(body["input"])
        assert items[:len(context)] == context and len(items) == len(context) + inputs, (call.tag, items, context)
        if step.delete:
            deleted = await client.delete(f"/v1/responses/{response_id}")
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            check_error_shape(await client.get(f"/v1/responses/{response_id}"), 404, None)
            check_error_shape(await client.delete(f"/v1/responses/{response_id}"), 404, None)
            after = await client.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                             "previous_response_id": response_id})
            check_error_shape(after, 400, "previous_response_id")
            statuses += [404, 404, 400]
        else:
            previous, context = response_id, items + [item["id"] for item in got.json()["output"]]


# ---------------------------------------------------------------- metrics


def scrape(url: str, prefix: str) -> dict[tuple, float]:
    """(name without the prefix, labels without model_name) -> value; every series names the model."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            assert s.name.startswith(prefix), s.name
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[s.name[len(prefix):], labels] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


REASONS = ("stop", "length", "abort", "error")


def check_metrics(before: dict, after: dict, recorded: Recorded, calls: list[Call], statuses: list[int]) -> None:
    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    finals = recorded.finals
    # each engine request ended once, with its reason: the engine's, or abort where its client left first
    assert sum(delta("request_success_total", finished_reason=r) for r in REASONS) == len(finals)
    assert delta("request_success_total", finished_reason="error") == 0
    engine_ended = {r: sum(1 for f in finals.values() if f.finish_reason == r) for r in REASONS}
    for reason in ("stop", "length"):
        assert delta("request_success_total", finished_reason=reason) <= engine_ended[reason]
    left = {f"chatcmpl-{c.tag}" if c.kind == "chat" else f"cmpl-{c.tag}" for c in calls if c.left}
    left |= {c.response_id for c in calls if c.left and c.response_id}
    finished_after_leaving = sum(1 for rid, f in finals.items()
                                 if f.finish_reason != "abort" and rid.rsplit("-", 2)[0] in left)
    aborted = delta("request_success_total", finished_reason="abort")
    assert engine_ended["abort"] <= aborted <= engine_ended["abort"] + finished_after_leaving

    # tokens: the engine's counters are its requests'; the server's histograms one observation per engine request
    prompt_tokens = sum(recorded.prompts.values())
    generated = sum(len(f.token_ids) for f in finals.values())
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("generation_tokens_total") == generated
    assert delta("request_prompt_tokens_sum") == prompt_tokens
    assert delta("request_generation_tokens_sum") <= generated  # an aborted request's: what reached the server
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "e2e_request_latency_seconds"):
        assert delta(name + "_count") == len(finals), name
        assert delta(name + "_bucket", le="+Inf") == len(finals), name
    phases = {delta(f"request_{p}_time_seconds_count") for p in ("queue", "prefill", "decode", "inference")}
    assert len(phases) == 1 and phases.pop() <= len(finals)
    assert delta("time_to_first_token_seconds_count") <= len(finals)
    # per prompt: each prompt of each request that reached the engine (a response: one), its n
    groups = {}
    for rid in finals:
        head, index, _ = rid.rsplit("-", 2)
        groups.setdefault(head, set()).add(int(index))
    by_head = {f"chatcmpl-{c.tag}" if c.kind == "chat" else f"cmpl-{c.tag}": c for c in calls
               if c.kind in ("chat", "completion")}
    prompts = n_sum = 0
    for head, indexes in groups.items():
        call = by_head.get(head)
        n, count = (call.n, call.prompts) if call is not None else (1, 1)
        assert indexes == set(range(n * count)), head
        prompts += count
        n_sum += n * count
    assert delta("request_params_n_count") == delta("request_max_num_generation_tokens_count") == prompts
    assert delta("request_params_n_sum") == n_sum

    # errors: each 4xx answered (the catalogue's, the context's, the chains'); 499 at most once per client that
    # left; nothing else (no 5xx)
    sent: dict[str, int] = {}
    for status in [c.status for c in calls if c.status is not None and c.status >= 400] + statuses:
        sent[str(status)] = sent.get(str(status), 0) + 1
    counted = {dict(labels)["status"]: v - before.get((name, labels), 0.0) for (name, labels), v in after.items()
               if name == "request_errors_total"}
    counted = {k: v for k, v in counted.items() if v}
    left_count = counted.pop("499", 0)
    # a client that gave up before its answer saw no status: the server counted a 499, or (its refusal already
    # decided when the disconnect was seen: a loaded CI machine takes more than the 5-100 ms a client waits) a 4xx
    unseen = {k: counted.get(k, 0) - sent.get(k, 0) for k in {*counted, *sent}}
    assert all(v >= 0 for v in unseen.values()), (counted, sent)  # every 4xx a client saw was counted
    assert sum(unseen.values()) + left_count <= sum(1 for call in calls if call.left), (counted, sent, left_count)


# ---------------------------------------------------------------- the churn


def idle(engine, async_engine) -> bool:
    stats = engine.stats()
    return (not engine.has_unfinished_requests() and stats.num_running == 0 and stats.num_waiting == 0
            and not async_engine._queues and not async_engine._serving)


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def same(a, b) -> bool:
    """Equal, logprobs within 1e-4 (a batch's fp32 sums differ from a lone request's in the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-4)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def normalized(call: Call) -> object:
    """What must not change when the request is served alone, not streamed (ids, times and call ids aside)."""
    if call.kind == "responses":
        body = response_of(call)
        items = [(i["type"], i.get("status"), [p["text"] for p in i.get("content", [])], i.get("name"),
                  i.get("arguments")) for i in body["output"]]
        return body["status"], items, body["usage"]["output_tokens"], body["usage"]["input_tokens"]
    choices, _ = chat_choices(call) if call.kind == "chat" else completion_choices(call)
    for choice in choices.values():
        choice.pop("usages")
        choice.pop("prompt_logprobs", None)  # not with stream
    return choices


@dataclass
class Profile:
    options: dict  # the engine's
    prefix: str = "radiance_"  # the metric names'
    template: str = TEMPLATE


PROFILES = [
    Profile(dict(max_num_seqs=6, num_gpu_blocks_override=20, block_size=8)),  # tight: preemptions
    Profile(dict(max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=16, overlap_decode=True),
            "vllm:"),
    Profile(dict(max_num_seqs=3, ngram_draft_tokens=3, enable_prefix_caching=False), template=THINK_TEMPLATE),
    Profile(dict(max_num_seqs=8, max_model_len=128, block_size=4, overlap_decode=True), "vllm:"),  # outputs reach it
    Profile(dict(max_num_seqs=2, num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=32), "vllm:",
            THINK_TEMPLATE),
]


def churn(model_path: str, seed: int, num_calls: int = 36) -> list[Call]:
    rng = random.Random(seed)
    profile = PROFILES[seed % len(PROFILES)]
    prefix, think = profile.prefix, profile.template is THINK_TEMPLATE
    engine = make_engine(model_path, **profile.options)
    recorded = Recorded(engine)
    calls, chains = scenario(rng, num_calls, engine.max_model_len, think)
    chain_calls: list[Call] = []
    statuses: list[int] = []  # the chains' 4xx answers beside their calls
    with serve(engine, prefix, profile.template) as (url, state, async_engine):
        before = scrape(url, prefix)

        async def run():
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                start = time.monotonic()
                jobs = [send(client, call, start) for call in calls]
                jobs += [run_chain(client, steps, f"r{k}", start, rng.random(), chain_calls, statuses)
                         for k, steps in enumerate(chains)]
                await asyncio.gather(*jobs)
                # the server still serves
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "the", "max_tokens": 2})
                assert r.status_code == 200, r.text

        asyncio.run(run())
        assert wait_for(lambda: idle(engine, async_engine)), engine.stats()
        every = calls + chain_calls

        # each answer
        for call in every:
            if call.left:
                continue
            if call.expect is not None:
                check_error(call)
            elif call.kind in ("chat", "completion"):
                check_tool_calls(call, check_generation(call, recorded, think))
            elif call.kind == "responses":
                check_response(call, recorded, think)
            elif call.kind == "tokenize":
                assert call.status == 200 and call.answer["count"] == len(call.answer["tokens"])
                assert call.answer["tokens"] == engine.tokenizer.encode(call.body["prompt"])
            elif call.kind == "side":
                assert call.status == 200, (call.path, call.answer)
                if call.path == "/metrics":
                    assert list(text_string_to_metric_families(call.answer))
            elif call.kind == "detokenize":
                assert call.status == 200 and call.answer["prompt"] == engine.tokenizer.decode(call.body["tokens"])

        # the engine is idle, every request ended once, nothing held; no response left in progress
        bm = engine.block_manager
        assert engine.sequences == {} and engine.detokenizers == {} and not engine._aborted
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # cached blocks are free, evictable
        assert engine.stats().kv_cache_usage == 0.0
        assert set(recorded.finals) == set(recorded.prompts)
        assert not [kept for kept in state.responses._items.values() if kept.stored.in_progress]
        for call in every:  # a stream its client left is stored cancelled (unless it ended first)
            if call.kind == "responses" and call.left and call.response_id:
                stored = state.responses.get(call.response_id)
                if call.deleted:  # deleted while it streamed: not stored again as cancelled
                    assert stored is None, (call.tag, stored.body["status"])
                    continue
                assert stored is not None and stored.body["status"] in ("cancelled", "completed", "incomplete"), (
                    call.tag, call.body, stored and stored.body["status"], call.answer[-3:])

        # /metrics parses and adds up (the extra request above included)
        assert wait_for(lambda: sum(value(scrape(url, prefix), "request_success_total", finished_reason=r)
                                    for r in REASONS) >= len(recorded.finals), timeout=5)
        check_metrics(before, scrape(url, prefix), recorded, every, statuses)

        # greedy and seeded answers are those of the same request alone, not streamed; a chat's prompt is what
        # /tokenize counts for its messages
        replays = [call for call in every if not call.left and call.expect is None and call.deterministic
                   and call.kind in ("chat", "completion", "responses") and call.status == 200
                   and (not call.body.get("previous_response_id")
                        or state.responses.get(call.body["previous_response_id"]) is not None)]

        async def replay():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                for call in replays:
                    body = {k: v for k, v in call.body.items() if k not in ("stream", "stream_options")}
                    alone = Call(call.tag + "alone", call.kind, call.method, call.path, body, prompts=call.prompts)
                    await send(client, alone, time.monotonic())
                    assert alone.status == 200, (alone.tag, alone.answer)
                    want, got = normalized(call), normalized(alone)
                    assert same(got, want), (call.tag, call.body, want, got)
                    if call.kind == "chat" and body.get("tool_choice") not in ("required",) and not isinstance(
                            body.get("tool_choice"), dict):
                        keys = ("messages", "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
                                "chat_template_kwargs")
                        r = await client.post("/tokenize", json={k: body[k] for k in keys if k in body})
                        assert r.status_code == 200, r.text
                        assert r.json()["count"] == alone.answer["usage"]["prompt_tokens"], (call.tag, r.json())

        asyncio.run(replay())
    return every


@pytest.mark.parametrize("seed", range(2 * len(PROFILES)))
def test_server_churn(model_path, seed):
    churn(model_path, seed)


# ---------------------------------------------------------------- what the churn found, as focused repros


@pytest.fixture(scope="module")
def server(model_path):
    """The tiny model served alone (default engine options); yields (base URL, ServerState)."""
    with serve(make_engine(model_path)) as (url, state, _):
        yield url, state


def _post_raw(url: str, path: str, raw: str) -> httpx.Response:
    """A body sent as written (httpx cannot encode a str with a lone surrogate as JSON for us)."""
    return httpx.post(url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the", "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}], "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}], "logprobs": True, "stream": True}),
])
def test_logprobs_of_tokens_without_text_are_returned(server, path, body):
    """Every generated token has its logprob (as vLLM returns them), EOS tokens that ignore_eos lets through too:
    3 tokens generated (usage), 3 logprobs. Here: none."""
    body = {**body, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"0": 100}}  # 0: <eos>
    r = httpx.post(server[0] + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = sse_events(r.text.splitlines())
        entries = [e for event in events[:-1] for c in event["choices"] if c["logprobs"]
                   for e in c["logprobs"]["content"]]
        tokens = 3
    else:
        choice = r.json()["choices"][0]
        entries = choice["logprobs"]["tokens"] if "text" in choice else choice["logprobs"]["content"]
        tokens = r.json()["usage"]["completion_tokens"]
    assert tokens == 3
    assert len(entries) == 3, entries


def test_logprobs_after_an_eos_in_the_output_keep_their_tokens_and_offsets(server):
    """EOS and 'a' only (ignore_eos; the frequency penalty makes them take turns): every token's logprob, each
    at the offset where its text starts ('<eos>' adds none). Here the first EOS's 5 characters pass the whole
    text: 1 logprob of 8."""
    url, state = server
    a = state.tokenizer.encode("a")[0]
    body = {"prompt": "the", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "allowed_token_ids": [0, a],
            "frequency_penalty": 2.0, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    if not 0 < len(choice["text"]) < usage["completion_tokens"]:
        pytest.skip(f"the model wrote no mix of EOS and 'a' here: {choice['text']!r}")
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert len(tokens) == usage["completion_tokens"] == 8, tokens
    texts = ["" if t == "<eos>" else t for t in tokens]
    assert offsets == [sum(map(len, texts[:i])) for i in range(len(texts))], offsets
    assert "".join(texts) == choice["text"]


# a string with a lone UTF-16 surrogate, as JSON writes it (Python's json parses it into a str UTF-8 cannot encode)
LONE = '"a\\ud800b"'


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "model": %s}' % LONE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "model": %s}' % LONE),
    ("/tokenize", '{"prompt": "x", "model": %s}' % LONE),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "metadata": {"k": %s}}' % LONE),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "metadata": {"k": %s}, "stream": true}' % LONE),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "user": %s}' % LONE),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "json_object", "name": %s}}}'
     % LONE),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", '
                      '"description": %s}]}' % LONE),
    ("/v1/responses", '{"input": [{"type": "message", "role": "user", "content": "x", "id": %s}], '
                      '"max_output_tokens": 2}' % LONE),
])
def test_a_lone_surrogate_the_answer_would_echo_is_no_500(server, path, raw):
    """Refused up front (a 4xx, as a lone surrogate in the prompt or the messages is: serving_common.check_unicode),
    or served whole (the answer escapes it); never a 500, a cut stream, or a stored response that cannot be read
    back."""
    url, state = server
    try:
        r = _post_raw(url, path, raw)
    except httpx.RemoteProtocolError:  # the stream died mid-way: no status to check
        pytest.fail("the stream was cut without its end")
    if r.status_code != 200:  # refused (the model's name: not served, a 404)
        check_error_shape(r, r.status_code, None)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        return
    if "stream" in raw:
        events = sse_events(r.text.splitlines())
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        response_id = events[-1]["response"]["id"]
    else:
        response_id = r.json().get("id")
    if path == "/v1/responses":  # what was stored reads back
        for tail in ("", "/input_items"):
            got = httpx.get(f"{url}/v1/responses/{response_id}{tail}")
            assert got.status_code == 200, (tail, got.status_code, got.text)
