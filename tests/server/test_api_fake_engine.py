"""The HTTP layer against a scripted engine: shapes, streaming, parsers, errors, auth, disconnects."""

import json
import logging
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from radiance.config import ServerConfig
from radiance.engine.structured_output import StructuredOutput
from radiance.server.api import build_app
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, calls_content_reason, serve_in_thread
from tests.server.malformed import MALFORMED, body_bytes, check_error_shape

KEY = "sk-test-key"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    state = ServerState(ServerConfig(served_model_name=("fake", "fake-alias"), api_key=KEY, max_n=8),
                        engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def http(server, method, path, body=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    if body is not None:
        headers["Content-Type"] = "application/json"
    return httpx.request(method, server[0] + path, content=body, headers=headers, timeout=30, **kw)


def sse_events(text):
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(client, say, **kw):
    return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "SAY:" + say}], **kw)


def test_chat_non_streaming_shape_and_usage(client, server):
    r = chat(client, "Hello world")
    assert r.object == "chat.completion" and r.model == "fake"
    assert r.choices[0].message.content == "Hello world"
    assert r.choices[0].finish_reason == "stop"
    prompt_ids = server[1].requests[-1][1]
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len("Hello world")


def test_chat_streaming_matches_non_streaming(client):
    chunks = list(chat(client, "Streamed text", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streamed text"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("Streamed text")


def test_alias_and_models(client):
    assert [m.id for m in client.models.list().data] == ["fake", "fake-alias"]
    r = client.chat.completions.create(model="fake-alias", messages=[{"role": "user", "content": "SAY:x"}])
    assert r.model == "fake-alias" and r.choices[0].message.content == "x"


def test_n_choices_get_consecutive_seeds(client, server):
    r = chat(client, "abc", n=3, seed=40, temperature=0.7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    seeds = sorted(p.seed for _, _, p in server[1].requests[-3:])
    assert seeds == [40, 41, 42]
    assert all(p.temperature == 0.7 and p.n == 1 for _, _, p in server[1].requests[-3:])


def test_penalties_and_logit_bias_reach_the_engine(client, server):
    chat(client, "abc", presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"7": -100, "12": 2.5},
         extra_body={"repetition_penalty": 1.2})
    p = server[1].requests[-1][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
    assert p.logit_bias == ((7, -100.0), (12, 2.5))
    client.completions.create(model="fake", prompt="abc", max_tokens=2)
    p = server[1].requests[-1][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, ())


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


@pytest.mark.parametrize("fields, want", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}),
     StructuredOutput(json=SCHEMA)),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "any"}}), StructuredOutput(json_object=True)),
    (dict(response_format={"type": "json_object"}), StructuredOutput(json_object=True)),
    (dict(response_format={"type": "text"}), None),
    (dict(structured_outputs={"regex": "[0-9]+"}), StructuredOutput(regex="[0-9]+")),
    (dict(structured_outputs={"choice": ["yes", "no"]}), StructuredOutput(choice=("yes", "no"))),
    (dict(guided_json=SCHEMA), StructuredOutput(json=SCHEMA)),
    (dict(guided_grammar='root ::= "a"'), StructuredOutput(grammar='root ::= "a"')),
    (dict(guided_choice=["x", "y"]), StructuredOutput(choice=("x", "y"))),
])
def test_output_constraints_reach_the_engine(client, server, fields, want):
    chat(client, "abc", extra_body=fields)
    assert server[1].requests[-1][2].structured_output == want
    client.completions.create(model="fake", prompt="abc", max_tokens=2, extra_body=fields)
    assert server[1].requests[-1][2].structured_output == want


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, server):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1."""
    prompt = server[1].tokenizer.encode("SAY:xy")
    r = client.completions.create(model="fake", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert server[1].requests[-1][2].prompt_logprobs == 1
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == [-1.0] * (len(prompt) - 1) and lp.token_logprobs[-1] == -0.5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(r.choices[0].text[:len(lp.tokens[0])])
    assert all(max(top.values()) == tok for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    r = client.completions.create(model="fake", prompt=prompt, logprobs=1, max_tokens=1)  # no echo: no prompt
    assert len(r.choices[0].logprobs.tokens) == 1 and server[1].requests[-1][2].prompt_logprobs is None


def test_max_tokens_and_stop(client):
    r = chat(client, "abcdefgh", max_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("abc", "length")
    r = chat(client, "one, two, three", stop=[", t"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("one", "stop")


def test_max_tokens_defaults_to_16_on_completions_and_to_the_context_on_chat(client, server):
    """OpenAI's (and vLLM's) completions default to 16 tokens; chat's max_tokens has no default."""
    client.completions.create(model="fake", prompt="abc")
    assert server[1].requests[-1][2].max_tokens == 16
    chat(client, "abc")
    assert server[1].requests[-1][2].max_tokens > 16


def test_chat_logprobs(client):
    r = chat(client, "hey", logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["h", "e", "y"]
    assert all(len(c.top_logprobs) == 2 and c.logprob == -0.5 for c in content)


@pytest.mark.parametrize("max_tokens", [None, 60])
def test_tool_calls_same_streaming_and_not(client, max_tokens):
    say = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    kw = dict(tools=TOOLS, max_tokens=max_tokens)
    whole = chat(client, say, **kw).choices[0]
    chunks = list(chat(client, say, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert "<tool_call" not in content and "<tool_call" not in (whole.message.content or "")
    assert content == (whole.message.content or "")
    assert [(t.function.name, t.function.arguments) for t in calls] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert reason == [whole.finish_reason]
    if max_tokens is None:
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
        assert json.loads(whole.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    else:  # cut inside the arguments: the name and the partial arguments, no markup as content
        assert whole.finish_reason == "length"
        assert whole.message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_leaves_text_alone(client, server):
    say = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    r = chat(client, say, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == say and not r.choices[0].message.tool_calls
    # the tools are in the prompt (vLLM's default; --exclude-tools-when-tool-choice-none drops them), no call parsed
    assert "<|tools|>" in server[1].tokenizer.decode(server[1].requests[-1][1])


def test_reasoning_split_when_template_opens_think(client):
    kw = dict(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = chat(client, "the plan</think>\n\nthe answer", **kw)
    message = r.choices[0].message
    assert message.content == "the answer"
    assert message.model_extra["reasoning_content"] == "the plan" == message.model_extra["reasoning"]
    chunks = list(chat(client, "the plan</think>\n\nthe answer", stream=True, **kw))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("the plan", "the answer")


def test_completions_batch_echo_logprobs_stream(client, server):
    r = client.completions.create(model="fake", prompt=["SAY:ab", "SAY:cd"], n=2, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["ab", "ab", "cd", "cd"]
    r = client.completions.create(model="fake", prompt="SAY:xy", echo=True)
    assert r.choices[0].text == "SAY:xyxy"
    r = client.completions.create(model="fake", prompt="SAY:xyz", logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["x", "y", "z"] and lp.text_offset == [0, 1, 2] and lp.top_logprobs[0] == {"x": -0.5}
    ids = server[1].tokenizer.encode("SAY:tok", add_special_tokens=False)
    r = client.completions.create(model="fake", prompt=ids)
    assert r.choices[0].text == "tok"
    text = "".join(c.choices[0].text for c in client.completions.create(model="fake", prompt="SAY:stream", stream=True)
                   if c.choices)
    assert text == "stream"


def test_context_length_error_names_both_numbers(server):
    r = http(server, "POST", "/v1/completions", {"model": "fake", "prompt": "SAY:x", "max_tokens": 600})
    check_error_shape(r, 400, "max_tokens")
    prompt_len = len(server[1].tokenizer.encode("SAY:x"))
    message = r.json()["error"]["message"]
    assert "maximum context length is 512 tokens" in message
    assert f"you requested {prompt_len + 600} tokens ({prompt_len} in the prompt, 600 for the completion)" in message


def test_the_implicit_max_tokens_is_named_where_it_does_not_fit(server):
    """Completions' default of 16 past the room a prompt leaves is refused, as OpenAI and vLLM refuse it, and the
    message now says that 16 is the default the client never sent; a 16 it sends reads as before."""
    prompt = [104] * 508
    r = http(server, "POST", "/v1/completions", {"model": "fake", "prompt": prompt})
    check_error_shape(r, 400, "max_tokens")
    assert "(508 in the prompt, 16 for the completion)" in r.json()["error"]["message"]
    assert "max_tokens was not sent: completions default to 16" in r.json()["error"]["message"]
    r = http(server, "POST", "/v1/completions", {"model": "fake", "prompt": prompt, "max_tokens": 16})
    check_error_shape(r, 400, "max_tokens")
    assert "not sent" not in r.json()["error"]["message"]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_request(server, case):
    _, method, path, body, status, param = case
    r = http(server, method, path, body_bytes(body, "fake", 10_000))
    check_error_shape(r, status, param)


def test_normal_request_right_after_malformed(server, client):
    for case in MALFORMED[:5]:
        http(server, case[1], case[2], body_bytes(case[3], "fake", 10_000))
    assert chat(client, "still fine").choices[0].message.content == "still fine"


def test_api_key(server):
    for key in (None, "wrong"):
        r = http(server, "GET", "/v1/models", key=key)
        check_error_shape(r, 401, None)
    for path in ("/health", "/metrics", "/version"):
        assert http(server, "GET", path, key=None).status_code == 200


def test_stream_failure_midway_sends_error_then_done(server, client):
    r = http(server, "POST", "/v1/chat/completions",
             {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "SAY:abcFAILxyz"}]})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert "error" in events[-1] and events[-1]["error"]["code"] is None
    assert "Traceback" not in r.text and "scripted engine failure" not in r.text
    r = http(server, "POST", "/v1/chat/completions",
             {"model": "fake", "messages": [{"role": "user", "content": "SAY:abcFAILxyz"}]})
    check_error_shape(r, 500, None)
    assert "scripted engine failure" not in r.text
    metrics = http(server, "GET", "/metrics").text
    assert 'radiance_request_errors_total{model_name="fake",status="500"}' in metrics  # though outside the middleware


def test_metrics_and_tokenize(server, client):
    chat(client, "metrics please")
    text = http(server, "GET", "/metrics").text
    for name in ("radiance_num_requests_running", "radiance_num_requests_waiting", "radiance_kv_cache_usage_perc",
                 "radiance_prompt_tokens_total", "radiance_generation_tokens_total", "radiance_num_preemptions_total",
                 "radiance_spec_decode_num_draft_tokens_total",
                 "radiance_time_to_first_token_seconds_bucket", "radiance_time_per_output_token_seconds_count",
                 "radiance_e2e_request_latency_seconds_count"):
        assert name in text, name
    r = http(server, "POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()
    assert r["tokens"] == [104, 105] and r["count"] == 2 and r["max_model_len"] == 512
    assert http(server, "POST", "/detokenize", {"tokens": [104, 105]}).json() == {"prompt": "hi"}
    info = http(server, "GET", "/tokenizer_info").json()  # what lm-eval's remote tokenizer reads first
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", 512)


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def raw_post(url, path, body, key=KEY):
    """Send a POST on a plain socket (to hang up whenever the test wants)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_request(server, stream, caplog):
    caplog.set_level(logging.INFO, logger="radiance.server")
    engine = server[1]
    body = {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "SAY:SLOW" + "z" * 200}]}
    sock = raw_post(server[0], "/v1/chat/completions", body)
    try:
        assert _wait(lambda: len(engine.active) == 1)
        if stream:
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    assert _wait(lambda: not engine.active), engine.active
    assert engine.aborted and engine.aborted[-1].startswith("chatcmpl-")
    time.sleep(0.5)  # the handler finishes after the abort; a hang-up is not an internal error
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    # logged alike for both (a dropped stream left no line at INFO)
    what = "stream" if stream else "request"
    assert _wait(lambda: [r for r in caplog.records if r.getMessage() == f"client disconnected; {what} aborted"])


def test_health_is_503_while_loading():
    gate = threading.Event()
    engine = FakeEngine()

    def slow_factory():
        gate.wait(10)
        return engine

    state = ServerState(ServerConfig(), engine_factory=slow_factory)
    with serve_in_thread(build_app(state)) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "model loading"
        assert [httpx.get(url + path).status_code for path in ("/health", "/ping", "/health")] == [503] * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "SAY:x"})
        check_error_shape(r, 503, None)
        gate.set()
        assert _wait(lambda: httpx.get(url + "/health").status_code == 200)
        r = httpx.post(url + "/v1/completions", json={"prompt": "SAY:x"})
        assert r.json()["choices"][0]["text"] == "x" and r.json()["model"] == "fake-model"
        # a readiness probe's "not yet" is no failed request: the completion's 503 alone is counted (every probe
        # of a deploy was an error before)
        metrics = httpx.get(url + "/metrics").text
        counts = re.findall(r'radiance_request_errors_total\{model_name="[^"]*",status="503"\} (\S+)', metrics)
        assert sum(map(float, counts)) == 1.0, metrics


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_prefills_the_call(client, server, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, '{"city": "Rome"}}</tool_call>', tools=TOOLS, tool_choice=choice, stream=stream)
    calls, content, reason = calls_content_reason(r, stream)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert content == "" and reason == "stop"  # OpenAI's and vLLM's for a named tool_choice
    prompt = server[1].tokenizer.decode(server[1].requests[-1][1])
    assert prompt.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    grammar = server[1].requests[-1][2].structured_output.grammar  # the rest held to the tool's schema
    assert '"\\"city\\""' in grammar and "</tool_call>" in grammar


def test_qwen3_coder_forced_and_strict_calls_are_held_to_the_tools():
    """With Qwen3-coder markup a named call's prompt ends with its XML opening, the rest is held to the
    tool's schema (the grammar accepts the model's parameters and the call's end), and the call parses;
    strict functions under tool_choice auto get a grammar too."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    engine = FakeEngine()
    state = ServerState(ServerConfig(served_model_name=("fake",), tool_call_parser="qwen3_coder"),
                        engine_factory=lambda: engine)
    state.attach(engine)
    rest = "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    with serve_in_thread(build_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = chat(client, rest, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        prompt = engine.tokenizer.decode(engine.requests[-1][1])
        assert prompt.endswith("<tool_call>\n<function=get_weather>\n")
        grammar = xgr.Grammar.from_ebnf(engine.requests[-1][2].structured_output.grammar)
        assert _is_grammar_accept_string(grammar, rest)
        assert not _is_grammar_accept_string(grammar, rest.replace("city", "town"))

        strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
        r = chat(client, "It is sunny.", tools=strict)
        assert r.choices[0].message.content == "It is sunny."
        grammar = xgr.Grammar.from_ebnf(engine.requests[-1][2].structured_output.grammar)
        assert _is_grammar_accept_string(grammar, "It is sunny.")
        assert not _is_grammar_accept_string(grammar, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


# the shape of Llama 3.1's template: tools as JSON in the user turn, a call written as the whole answer
# (turns end with the fake engine's <|end|> where Llama has <|eot_id|>)
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% set c = m.tool_calls[0].function %}"
    '{{ \'{"name": "\' + c.name + \'", "parameters": \' }}{{ c.arguments | tojson }}}'
    "{% else %}{% if tools and m.role == 'user' %}{% for t in tools %}{{ t | tojson }}{% endfor %}\n\n"
    "{% endif %}{{ m.content }}{% endif %}<|end|>{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")


def test_llama3_json_tool_calls():
    """A Llama 3.x template picks the llama3_json parser: an answer that is a JSON call becomes a tool call,
    text stays text, a named call's prompt ends with its JSON opening and the rest is held to the schema,
    and an assistant turn with a call renders back as the template writes it."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    engine = FakeEngine(chat_template=LLAMA_LIKE)
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    assert state.tool_parser_name == "llama3_json"
    with serve_in_thread(build_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for stream in (False, True):
            r = chat(client, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', tools=TOOLS, stream=stream)
            calls, _, reason = calls_content_reason(r, stream)
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
            assert reason == "tool_calls"
        r = chat(client, "It is sunny in Oslo.", tools=TOOLS)
        assert r.choices[0].message.content == "It is sunny in Oslo." and not r.choices[0].message.tool_calls

        rest = '{"city": "Rome"}}'
        r = chat(client, rest, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        assert engine.tokenizer.decode(engine.requests[-1][1]).endswith('{"name": "get_weather", "parameters": ')
        grammar = xgr.Grammar.from_ebnf(engine.requests[-1][2].structured_output.grammar)
        assert _is_grammar_accept_string(grammar, rest) and not _is_grammar_accept_string(grammar, '{"city": 1}}')
        chat(client, '"get_weather", "parameters": {}}', tools=TOOLS, tool_choice="required")
        assert engine.tokenizer.decode(engine.requests[-1][1]).endswith('<|end_header_id|>\n\n{"name": ')

        strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
        r = chat(client, "It is sunny.", tools=strict)  # auto + strict: a call opening the answer is held
        assert r.choices[0].message.content == "It is sunny."
        grammar = xgr.Grammar.from_ebnf(engine.requests[-1][2].structured_output.grammar)
        assert _is_grammar_accept_string(grammar, "It is sunny.")
        assert _is_grammar_accept_string(grammar, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
        assert not _is_grammar_accept_string(grammar, '{"name": "get_time", "parameters": {}}')

        history = [{"role": "user", "content": "weather?"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "SAY:sunny"}]
        client.chat.completions.create(model="fake", messages=history)
        prompt = engine.tokenizer.decode(engine.requests[-1][1])
        assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt


def test_forced_tool_call_with_an_unusable_parameters_schema_is_a_400(server):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}
    r = http(server, "POST", "/v1/chat/completions", body)
    check_error_shape(r, 400, "tools")
    assert "bogus" in r.json()["error"]["message"]


def test_streaming_n_choices_each_complete(client):
    chunks = list(chat(client, "two ways", n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == "two ways"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]


def test_engine_that_stopped_answers_503():
    engine = FakeEngine()
    state = ServerState(ServerConfig(), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        assert httpx.post(url + "/v1/completions", json={"prompt": "SAY:x"}).status_code == 200
        engine.errored = RuntimeError("CUDA error")  # what AsyncLLMEngine records when a step fails
        check_error_shape(httpx.post(url + "/v1/completions", json={"prompt": "SAY:x"}), 503, None)
        assert httpx.get(url + "/health").status_code == 503
        assert "CUDA error" not in httpx.post(url + "/v1/completions", json={"prompt": "SAY:x"}).text


def test_strict_tools_constrain_auto_calls(client, server):
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    chat(client, "x", tools=TOOLS)
    assert server[1].requests[-1][2].structured_output is None  # not strict: the model writes freely
    chat(client, "x", tools=strict)
    held = server[1].requests[-1][2].structured_output
    assert held is not None and "get_weather" in held.grammar
    chat(client, "x", tools=strict, parallel_tool_calls=False)
    assert server[1].requests[-1][2].structured_output.grammar != held.grammar  # one call at most
    chat(client, "x", tools=strict, response_format={"type": "json_object"})
    assert server[1].requests[-1][2].structured_output.json_object  # one constraint: the response format
    chat(client, "x", tools=strict, tool_choice="none")
    assert server[1].requests[-1][2].structured_output is None


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_tokenizing():
    """A text longer than max_model_len tokens of the vocabulary's longest token is a 400
    (context_length_exceeded) without running the tokenizer (a 10 MB message took 13 s to tokenize and
    stalled the server); a text within the bound is tokenized as usual."""
    from types import SimpleNamespace

    from radiance.server.errors import OpenAIError
    from radiance.server.serving_common import encode_prompt
    from radiance.server.state import longest_token_chars

    class VocabTokenizer:
        calls = 0

        def get_vocab(self):
            return {"a": 0, "abcd": 1, "<|end|>": 2}

        def encode(self, text, add_special_tokens=True):
            VocabTokenizer.calls += 1
            return [0] * len(text)

    tok = VocabTokenizer()
    assert longest_token_chars(tok) == 7 and longest_token_chars(object()) is None
    state = SimpleNamespace(tokenizer=tok, max_model_len=10, max_token_chars=longest_token_chars(tok))
    assert len(encode_prompt(state, "a" * 70, "prompt")) == 70  # within the bound: tokenized (and left to the
    with pytest.raises(OpenAIError) as err:                       # context check after it)
        encode_prompt(state, "a" * 71, "messages")
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert VocabTokenizer.calls == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_follow_their_tokens_when_stop_strings_hold_text_back(client, stream):
    """text_offset counts the tokens' own text (not the text sent so far, which a possible stop string holds
    back), and while streaming a token's logprob goes out in the chunk that carries its text."""
    args = dict(model="fake", prompt="SAY:1, 2, 3, 4", max_tokens=20, logprobs=0, stop=[", 4"])
    if not stream:
        r = client.completions.create(**args)
        assert r.choices[0].text == "1, 2, 3"
        lp = r.choices[0].logprobs
        # the stop string's tokens are not the text's: their logprobs are left out (text_offset never passes the end)
        assert "".join(lp.tokens) == "1, 2, 3" and lp.text_offset == list(range(len(lp.tokens)))
        return
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == "1, 2, 3"
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == list(range(len(offsets)))
    for c in chunks:
        assert "".join(c.logprobs.tokens if c.logprobs else []) == c.text, c


def test_chat_stream_logprobs_go_out_with_their_text(client):
    """Chat streaming: a token's logprob goes out in the chunk that carries its text, also while a possible
    stop string holds text back; the stop string's own tokens get none (they were sent with the last chunk)."""
    stream = chat(client, "1, 2, 3, 4", stream=True, logprobs=True, stop=[", 4"])
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "1, 2, 3"
    for c in chunks:
        assert "".join(e.token for e in (c.logprobs.content if c.logprobs else [])) == (c.delta.content or ""), c


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_the_stop_string_cuts_keeps_its_logprob(client, stream):
    """The logprobs follow the text: a token the cut splits contributed text, so it keeps its logprob; the tokens
    after it do not."""
    r = chat(client, "I'm glad you came", stream=stream, logprobs=True, stop=["d you"])
    if stream:
        chunks = [c.choices[0] for c in r if c.choices]
        content = "".join(c.delta.content or "" for c in chunks)
        tokens = "".join(e.token for c in chunks if c.logprobs for e in c.logprobs.content)
    else:
        content, tokens = r.choices[0].message.content, "".join(e.token for e in r.choices[0].logprobs.content)
    assert content == "I'm gla" and tokens.startswith(content) and len(tokens) <= len("I'm glad")


def test_tokens_sent_counts_the_text_that_went_out():
    from radiance.server.logprobs_json import token_chars, tokens_sent

    assert tokens_sent(["1", ",", " 2", ","], before=0, sent=3) == 2  # " 2" ends at 4 > 3: held
    assert tokens_sent([" 2", ","], before=2, sent=5) == 2
    # two tokens of one emoji decode alone to U+FFFD each and count nothing, so they never hold back the rest
    assert token_chars("\ufffd") == 0 and token_chars(" \ufffd") == 1
    assert tokens_sent(["a", "\ufffd", "\ufffd", "b"], before=0, sent=len("a\N{GRINNING FACE}b")) == 4


def test_an_empty_body_or_a_body_not_sent_as_json_gets_a_message_that_says_so(server):
    """An empty body was answered "Field required", and JSON sent as text/plain, as a form (curl -d) or with no
    Content-Type (requests.post(data=...)) "the request body must be a JSON object", which it is."""
    r = http(server, "POST", "/v1/chat/completions", b"")
    check_error_shape(r, 400, None)
    assert "empty" in r.json()["error"]["message"]
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "SAY:x"}]}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
        r = httpx.post(server[0] + "/v1/chat/completions", content=body, headers=headers, timeout=30)
        check_error_shape(r, 400, None)
        message = r.json()["error"]["message"]
        assert "Content-Type: application/json" in message and str(content_type or "none") in message, message


def test_null_optional_fields_take_their_defaults(client, server):
    """OpenAI's API documents these fields as nullable ("n": null is n = 1); a client that sends the null
    was refused with a 400."""
    nulls = dict.fromkeys(("n", "stream", "logprobs", "ignore_eos", "skip_special_tokens", "parallel_tool_calls",
                           "add_generation_prompt", "continue_final_message"))
    r = http(server, "POST", "/v1/chat/completions",
             {"model": "fake", "messages": [{"role": "user", "content": "SAY:nulls"}], **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "nulls" and len(r.json()["choices"]) == 1
    r = http(server, "POST", "/v1/completions", {"model": "fake", "prompt": "SAY:nulls", "n": None, "stream": None,
                                                 "echo": None, "logprobs": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "nulls"
    r = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:nulls", "stream": None, "store": None})
    assert r.status_code == 200, r.text
    r = http(server, "POST", "/v1/chat/completions", {"model": "fake", "messages": [{"role": None, "content": "x"}]})
    check_error_shape(r, 400, "messages[0].role")  # a required field stays required


def test_an_image_part_is_refused_by_name(server):
    """The content union (a string or text parts) answered an image part with "Input should be a valid string"."""
    image = {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    r = http(server, "POST", "/v1/chat/completions",
             {"model": "fake", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]})
    check_error_shape(r, 400, "messages[0]")
    message = r.json()["error"]["message"]
    assert "'image_url' are not supported" in message and "valid string" not in message, message


def test_unknown_request_fields_are_ignored_and_logged(server, caplog):
    """vLLM's extensions radiance lacks (`vllm_xargs`, `mm_processor_kwargs`) were ignored without a word: still
    served (as vLLM serves unknown fields), now with one warning naming them."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "SAY:ok"}], "mm_processor_kwargs": {},
            "vllm_xargs": {}}
    with caplog.at_level("WARNING", logger="radiance.server.protocol"):
        r = http(server, "POST", "/v1/chat/completions", body)
        known = http(server, "POST", "/v1/completions", {"model": "fake", "prompt": "SAY:ok"})
    assert r.status_code == 200 and known.status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if "ignored request fields" in rec.getMessage()]
    assert warned == ["ChatCompletionRequest: ignored request fields mm_processor_kwargs, vllm_xargs (not supported)"]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, stream):
    """vLLM's return_tokens_as_token_ids: every logprob token (chosen and alternatives) is "token_id:N", the ids of
    the text the answer carries; completions' text_offset still counts the tokens' texts."""
    tokenizer = server[1].tokenizer
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    names = [f"token_id:{i}" for i in ids]
    chat_body = {"model": "fake", "messages": [{"role": "user", "content": "SAY:hello world"}], "logprobs": True,
                 "top_logprobs": 1, "return_tokens_as_token_ids": True, "stream": stream}
    r = http(server, "POST", "/v1/chat/completions", chat_body)
    if stream:
        chunks = [e["choices"] for e in sse_events(r.text)]
        content = [t for c in chunks if c and c[0]["logprobs"] for t in c[0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == names
    assert all(alt["token"].startswith("token_id:") for t in content for alt in t["top_logprobs"])
    body = {"model": "fake", "prompt": "SAY:hello world", "logprobs": 1, "return_tokens_as_token_ids": True}
    lp = http(server, "POST", "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == names
    assert lp["text_offset"] == [len(tokenizer.decode(ids[:k])) for k in range(len(ids))]
