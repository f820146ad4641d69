"""Server follow-ups of the fifty-sixth session, each against vLLM's current OpenAI server (OpenAI's API for shapes).

1. `stream_options: {}` asks for nothing: accepted without stream (vLLM tests the object's truthiness); a stream with
   it carries no usage. One that sets a field still needs stream.
2. Error types stay OpenAI's (vLLM names them after the status), in bodies and stream events;
   a literal field's 400 says what was sent.
3. An assistant message sent back with `tool_calls: []` is a text turn (vLLM drops the empty list): templates that
   test `'tool_calls' in message` refused it. Answers without calls carry no tool_calls key (vLLM's, OpenAI's).
4. include_reasoning false hides the logprobs too (vLLM's rule): they named the reasoning's tokens, streamed as chunks
   with an empty delta.
5. tool_choice "none" with Mistral or harmony markup: no call is parsed, the text stays content.
6. usage.prompt_tokens_details.cached_tokens is always a number (0 without prefix-cache hits), as OpenAI sends it and
   vLLM with --enable-prompt-tokens-details; the details came only with a hit before.
7. reasoning_effort takes OpenAI's "xhigh" and vLLM's "max" (thinking on), on chat and /v1/responses.
"""

from __future__ import annotations

import json

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.reasoning_parser import HARMONY_MARKERS
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, serve_engine, serve_in_thread
from tests.server.test_harmony_tools import ANALYSIS, CALL_PARIS, TOOLS, TOOLS_TEMPLATE
from tests.server.test_mistral_tools import MISTRAL_V3_LIKE, OSLO, SPECIAL, WEATHER

HI = [{"role": "user", "content": "SAY:hi"}]
THINKING = [{"role": "user", "content": "SAY:<think>secret</think>ab"}]


@pytest.fixture(scope="module")
def url():
    with serve_engine(FakeEngine(), api_key="k", reasoning_parser="think", tool_call_parser="hermes") as base:
        yield base


def post(url: str, path: str, body: dict, key: str | None = "k") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json={"model": "fake", **body}, headers=headers, timeout=30)


def events(response: httpx.Response) -> list[dict]:
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", response.text
    return [json.loads(d) for d in data[:-1]]


# 1. stream_options {} -------------------------------------------------------------------------------------------

ROUTES = [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "SAY:hi"})]


@pytest.mark.parametrize("path,body", ROUTES)
def test_an_empty_stream_options_is_taken_without_stream_and_adds_no_usage(url, path, body):
    whole = post(url, path, {**body, "stream_options": {}})
    assert whole.status_code == 200, whole.text
    refused = post(url, path, {**body, "stream_options": {"include_usage": False}})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "stream_options")
    chunks = events(post(url, path, {**body, "stream": True, "stream_options": {}}))
    assert chunks and not any("usage" in c for c in chunks)


# 2. error types ---------------------------------------------------------------------------------------------------

def error_of(response: httpx.Response) -> tuple[int, str, str | None]:
    if response.headers["content-type"].startswith("text/event-stream"):
        [error] = [e["error"] for e in events(response) if "error" in e]
    else:
        error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return response.status_code, error["type"], error["code"]


def test_error_types_are_openais(url):
    """OpenAI's type strings (vLLM names them after the status: BadRequestError); `code` names the cause."""
    failing = [{"role": "user", "content": "SAY:abcdFAIL"}]
    bad = {"messages": HI, "temperature": 5}
    assert error_of(post(url, "/v1/chat/completions", bad)) == (400, "invalid_request_error", None)
    assert error_of(post(url, "/v1/chat/completions", {"messages": HI, "n": 99})) == (400, "invalid_request_error", None)
    assert error_of(post(url, "/v1/chat/completions", {"model": "nope", "messages": HI})) == (
        404, "invalid_request_error", "model_not_found")
    assert error_of(post(url, "/v1/nothing", {})) == (404, "invalid_request_error", "unknown_url")
    assert error_of(httpx.get(url + "/v1/chat/completions", headers={"Authorization": "Bearer k"})) == (
        405, "invalid_request_error", None)
    assert error_of(post(url, "/v1/chat/completions", {"messages": HI}, key=None)) == (
        401, "authentication_error", "invalid_api_key")
    assert error_of(post(url, "/v1/chat/completions", {"messages": failing})) == (500, "internal_server_error", None)
    assert error_of(post(url, "/v1/chat/completions", {"messages": failing, "stream": True})) == (
        200, "internal_server_error", None)
    missing = httpx.get(url + "/v1/responses/resp_nope", headers={"Authorization": "Bearer k"}, timeout=30)
    assert error_of(missing) == (404, "invalid_request_error", "not_found")


def test_a_literal_fields_400_says_what_was_sent(url):
    r = post(url, "/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith(", got 'xml'"), r.text
    assert r.json()["error"]["param"] == "response_format.type"


# 3. tool_calls [] -------------------------------------------------------------------------------------------------

# Llama 3.1's test: an assistant message with the key is a call turn, and holds exactly one call
LLAMA31_LIKE = ("{% for m in messages %}{% if 'tool_calls' in m %}{% if not m.tool_calls|length == 1 %}"
                "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
                "<|call|>{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}<|assistant|>SAY:ok")


def test_a_text_turn_sent_back_with_empty_tool_calls_renders_as_text():
    engine = FakeEngine(chat_template=LLAMA31_LIKE)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []},
               {"role": "user", "content": "again"}]
    with serve_engine(engine) as base:
        r = post(base, "/v1/chat/completions", {"messages": history}, key=None)
        tokenized = post(base, "/tokenize", {"messages": history}, key=None)
    assert r.status_code == 200, r.text
    assert "<|assistant|>hello<|end|><|user|>again" in engine.tokenizer.decode(engine.requests[-1][1])
    assert tokenized.status_code == 200 and tokenized.json()["count"] == r.json()["usage"]["prompt_tokens"]
    assert "tool_calls" not in r.json()["choices"][0]["message"]


# 4. include_reasoning false ---------------------------------------------------------------------------------------

def test_hidden_reasoning_hides_the_logprobs_that_would_name_it(url):
    shown = post(url, "/v1/chat/completions", {"messages": THINKING, "logprobs": True}).json()["choices"][0]
    assert "".join(t["token"] for t in shown["logprobs"]["content"]) == "<think>secret</think>ab"
    body = {"messages": THINKING, "logprobs": True, "include_reasoning": False}
    hidden = post(url, "/v1/chat/completions", body).json()["choices"][0]
    assert hidden["message"] == {"role": "assistant", "content": "ab", "refusal": None} and hidden["logprobs"] is None
    choices = [c["choices"][0] for c in events(post(url, "/v1/chat/completions", {**body, "stream": True}))]
    assert [c["delta"] for c in choices] == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert all(c["logprobs"] is None for c in choices)


# 5. tool_choice "none" with Mistral and harmony markup ------------------------------------------------------------

def answers(base: str, model: str, body: dict) -> list[tuple]:
    """(content, tool calls, finish reason) of the answer, whole and streamed."""
    choice = post(base, "/v1/chat/completions", {"model": model, **body}, key=None).json()["choices"][0]
    chunks = events(post(base, "/v1/chat/completions", {"model": model, **body, "stream": True}, key=None))
    deltas = [c["choices"][0] for c in chunks]
    return [(choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]),
            ("".join(d["delta"].get("content") or "" for d in deltas),
             [t for d in deltas for t in d["delta"].get("tool_calls") or []] or None,
             [d["finish_reason"] for d in deltas if d["finish_reason"]][0])]


def test_tool_choice_none_leaves_mistral_calls_as_text():
    engine = FakeEngine(chat_template=MISTRAL_V3_LIKE, special_tokens=SPECIAL)
    engine.reply = f"Let me check. [TOOL_CALLS] [{OSLO}]"
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER], "tool_choice": "none"}
    with serve_engine(engine) as base:
        got = answers(base, "fake", body)
    # the control token dropped (skip_special_tokens, as vLLM's Mistral parser leaves it under "none"), its JSON kept
    assert got == [(f"Let me check.  [{OSLO}]", None, "stop")] * 2
    assert engine.requests[-1][2].skip_special_tokens is True


def test_tool_choice_none_makes_no_harmony_call():
    engine = FakeEngine(chat_template=TOOLS_TEMPLATE, special_tokens=HARMONY_MARKERS)
    engine.reply = ANALYSIS + CALL_PARIS
    state = ServerState(ServerConfig(served_model_name=("gpt-oss",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as base:
        none = answers(base, "gpt-oss", {"messages": HI, "tools": TOOLS, "tool_choice": "none"})
        auto = answers(base, "gpt-oss", {"messages": HI, "tools": TOOLS})
    assert none == [('{"city":"Paris"}', None, "stop")] * 2  # the call's body is text, no markup
    assert [(len(calls), reason) for _, calls, reason in auto] == [(1, "tool_calls")] * 2


# 6. cached tokens -------------------------------------------------------------------------------------------------

class CachingEngine(FakeEngine):
    async def generate(self, request_id, prompt_token_ids, params):
        async for out in super().generate(request_id, prompt_token_ids, params):
            out.num_cached_tokens = 16
            yield out


@pytest.mark.parametrize("engine,cached", [(FakeEngine(), 0), (CachingEngine(), 16)], ids=["no-hits", "hits"])
def test_cached_tokens_are_always_a_number(engine, cached):
    with serve_engine(engine) as base:
        for path, body in ROUTES:
            whole = post(base, path, body, key=None).json()["usage"]
            assert whole["prompt_tokens_details"] == {"cached_tokens": cached}, (path, whole)
            options = {"include_usage": True, "continuous_usage_stats": True}
            *running, final = events(post(base, path, {**body, "stream": True, "stream_options": options}, key=None))
            assert final["usage"] == whole
            assert running and not any("prompt_tokens_details" in c["usage"] for c in running)  # vLLM's, as it goes


# 7. reasoning_effort ----------------------------------------------------------------------------------------------

PROBE = "{% for m in messages %}{% endfor %}SAY:{{ reasoning_effort }} {{ enable_thinking }}"


def test_reasoning_effort_takes_xhigh_and_max():
    with serve_engine(FakeEngine(chat_template=PROBE)) as base:
        for effort in ("xhigh", "max"):
            chat = post(base, "/v1/chat/completions", {"messages": HI, "reasoning_effort": effort}, key=None)
            assert chat.json()["choices"][0]["message"]["content"] == f"{effort} True", chat.text
            responses = post(base, "/v1/responses", {"input": "x", "reasoning": {"effort": effort}}, key=None)
            assert responses.json()["output"][0]["content"][0]["text"] == f"{effort} True", responses.text
        refused = post(base, "/v1/chat/completions", {"messages": HI, "reasoning_effort": "extreme"}, key=None)
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "reasoning_effort")
    assert "'xhigh'" in error["message"] and error["message"].endswith("got 'extreme'")


# 8. chat_template_content_format ------------------------------------------------------------------------------------

# a template that walks OpenAI's content parts (as multimodal templates do); a string's characters under "string"
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}S:{{ m.content }}{% else %}"
                  "{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endif %}<|end|>{% endfor %}"
                  "<|assistant|>SAY:ok")
PARTS = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "assistant", "content": "plain"}]


@pytest.mark.parametrize("content_format,expected", [
    ("auto", "<|user|>[a][b]<|end|><|assistant|>[plain]<|end|>"),  # the template loops over content: openai
    ("openai", "<|user|>[a][b]<|end|><|assistant|>[plain]<|end|>"),
    ("string", "<|user|>S:a\nb<|end|><|assistant|>S:plain<|end|>"),  # vLLM's join
])
def test_the_servers_content_format_shapes_what_the_template_reads(content_format, expected):
    engine = FakeEngine(chat_template=PARTS_TEMPLATE)
    with serve_engine(engine, chat_template_content_format=content_format) as base:
        r = post(base, "/v1/chat/completions", {"messages": PARTS}, key=None)
        cont = post(base, "/v1/chat/completions", {"messages": PARTS, "add_generation_prompt": False,
                                                   "continue_final_message": True}, key=None)
    assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(engine.requests[-2][1]).startswith(expected)
    # the continued message's prompt ends where its text does (the template's "]" after it cut off), either shape
    assert cont.status_code == 200, cont.text
    assert engine.tokenizer.decode(engine.requests[-1][1]).endswith(expected[:expected.rindex("plain") + 5])


def test_a_string_template_gets_joined_parts_by_default():
    engine = FakeEngine(chat_template=LLAMA31_LIKE)
    with serve_engine(engine) as base:
        r = post(base, "/v1/chat/completions", {"messages": PARTS}, key=None)
    assert r.status_code == 200, r.text
    assert "<|user|>a\nb<|end|><|assistant|>plain<|end|>" in engine.tokenizer.decode(engine.requests[-1][1])


def test_an_unknown_content_format_is_refused_at_startup():
    with pytest.raises(ValueError, match="chat_template_content_format.*got 'parts'"):
        ServerConfig(chat_template_content_format="parts")


# 9. structured_outputs' vLLM options ----------------------------------------------------------------------------

def test_structured_outputs_take_vllms_options_and_refuse_what_cannot_be_done(url):
    options = {"json_object": True, "disable_any_whitespace": True, "disable_additional_properties": False}
    taken = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": 'SAY:{"a": 1}'}],
                                               "structured_outputs": options})
    assert taken.status_code == 200, taken.text
    for option, value in (("whitespace_pattern", r"[ ]?"), ("structural_tag", "{}")):
        r = post(url, "/v1/chat/completions", {"messages": HI, "structured_outputs": {"json_object": True,
                                                                                      option: value}})
        assert r.status_code == 400 and f"{option} is not supported" in r.json()["error"]["message"], r.text
