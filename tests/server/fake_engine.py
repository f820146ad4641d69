"""A scripted stand-in for AsyncLLMEngine (ARCHITECTURE.md contract) and a byte tokenizer, so the
server's routes, parsers, errors and disconnect handling can be tested fast and deterministically.

The reply is the text after the last `SAY:` in the prompt (up to `<|end|>`), or `FakeEngine.reply` when
set, one byte per token (a special token, when the tokenizer has any, is one token). `FAIL` in the reply
makes generation raise after a few tokens; `SLOW` makes each token take 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time

import uvicorn

from radiance.server.streaming_text import partial_tag_start
from radiance.engine.outputs import EngineStats, StepOutput, TokenLogprob

BOS, EOS = 256, 257

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content if m.content else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


class ByteTokenizer:
    """`special_tokens` get ids 258, 259, ...: one token each in encode, dropped by decode unless
    skip_special_tokens is False (as a real tokenizer's added special tokens are)."""

    bos_token, eos_token = "<s>", "</s>"
    bos_token_id, eos_token_id = BOS, EOS

    def __init__(self, special_tokens: tuple[str, ...] = ()):
        self.special_tokens = special_tokens
        self._special_split = (re.compile("(" + "|".join(map(re.escape, special_tokens)) + ")")
                               if special_tokens else None)

    def __len__(self):
        return 258 + len(self.special_tokens)

    def encode(self, text, add_special_tokens=True):
        ids = [BOS] if add_special_tokens else []
        for piece in self._special_split.split(text) if self._special_split else [text]:
            if piece in self.special_tokens:
                ids.append(258 + self.special_tokens.index(piece))
            else:
                ids += piece.encode("utf-8")
        return ids

    def decode(self, ids, skip_special_tokens=True):
        pieces, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            elif i >= 258 and not skip_special_tokens:
                pieces += [run.decode("utf-8", errors="replace"), self.special_tokens[i - 258]]
                run = bytearray()
        return "".join(pieces) + run.decode("utf-8", errors="replace")

    def batch_decode(self, batch, skip_special_tokens=True):
        return [self.decode(ids, skip_special_tokens) for ids in batch]


class FakeEngine:
    def __init__(self, max_model_len=512, chat_template=TEMPLATE, special_tokens: tuple[str, ...] = ()):
        self.tokenizer = ByteTokenizer(special_tokens)
        self.tokenizer_error = None
        self.vocab_size = len(self.tokenizer)
        self.errored = None  # AsyncLLMEngine's: set when its loop stopped after an error
        self.reply: str | None = None  # when set, every request's reply (one with markup the prompt cannot carry)
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.chat_templates: dict[str, str] = {}
        self.model_name = "fake-model"
        self.load_summary = ["model: fake-model (scripted test engine)"]
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[tuple[str, list[int], object]] = []
        self.prompt_tokens = 0
        self.generated = 0

    def stats(self):
        return EngineStats(num_running=len(self.active), num_waiting=0, kv_cache_usage=0.1 * len(self.active),
                           num_preemptions=0, prompt_tokens_total=self.prompt_tokens,
                           generation_tokens_total=self.generated)

    async def check_structured_output(self, spec):
        if spec.regex is not None and "((" in spec.regex:  # scripted: the real engine's compile error
            raise ValueError("invalid regex constraint: unbalanced parentheses")

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.active.discard(request_id)

    async def generate(self, request_id, prompt_token_ids, params):
        self.requests.append((request_id, list(prompt_token_ids), params))
        self.active.add(request_id)
        self.prompt_tokens += len(prompt_token_ids)
        prompt = self.tokenizer.decode(prompt_token_ids)
        said = prompt.rsplit("SAY:", 1)[-1].split("<|end|>")[0] if "SAY:" in prompt else "ok"
        reply = said if self.reply is None else self.reply
        reply_ids = self.tokenizer.encode(reply, add_special_tokens=False)
        token_ids, logprobs = [], [] if params.logprobs is not None else None
        prompt_logprobs = None  # scored as -1.0 each, alternatives: the token itself
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [TokenLogprob(t, -1.0, [(t, -1.0)][:params.prompt_logprobs])
                                        for t in prompt_token_ids[1:]]
        try:
            for i, token in enumerate(reply_ids):
                if request_id not in self.active:
                    return
                if "FAIL" in reply and i == 3:
                    raise RuntimeError("scripted engine failure")
                await asyncio.sleep(0.05 if "SLOW" in reply else 0)
                token_ids.append(token)
                self.generated += 1
                if logprobs is not None:
                    logprobs.append(TokenLogprob(token, -0.5, [(token, -0.5), (32, -1.5)][:params.logprobs]))
                text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
                stop = next((s for s in params.stop if s in text), None)
                if stop is not None:
                    text = text[:text.index(stop)]
                    yield StepOutput(request_id, list(prompt_token_ids), text, list(token_ids), logprobs,
                                        "stop", True, prompt_logprobs=prompt_logprobs)
                    return
                cut = len(token_ids) >= params.max_tokens
                done = cut or i == len(reply_ids) - 1
                reason = ("length" if cut else "stop") if done else None
                if not done:  # hold back a possible start of a stop string, as a real engine does
                    text = text[:min([partial_tag_start(text, s) for s in params.stop] or [len(text)])]
                    text = text.rstrip("\ufffd")  # and a character whose bytes are not all generated yet
                yield StepOutput(request_id, list(prompt_token_ids), text, list(token_ids),
                                    None if logprobs is None else list(logprobs), reason, done,
                                    prompt_logprobs=prompt_logprobs)
                if done:
                    return
        finally:
            self.active.discard(request_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, port: int | None = None):
    """Run `app` under uvicorn in a thread; yields the base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_engine(engine, **server_config):
    """A server in a thread in front of `engine` (attached: ready at once), its ServerConfig serving the model
    name "fake" with `server_config`; yields the base URL."""
    from radiance.config import ServerConfig
    from radiance.server.api import build_app
    from radiance.server.state import ServerState

    state = ServerState(ServerConfig(served_model_name=("fake",), **server_config), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        yield url


def calls_content_reason(response, stream: bool) -> tuple[list, str, str]:
    """(tool calls, content, finish reason) of a chat completion from the openai client, streamed or whole."""
    if stream:
        chunks = list(response)
        calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        return calls, content, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]
    message = response.choices[0].message
    return message.tool_calls, message.content or "", response.choices[0].finish_reason
