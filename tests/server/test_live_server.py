"""A live `radiance serve` process on the embedded SmolLM2, driven by the official openai client.

One server for the whole module (loading takes ~20 s); outputs stay short (CPU decode is slow).
"""

import json
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live import running_server
from tests.server.malformed import MALFORMED, body_bytes, check_error_shape

KEY = "sk-live-test"
MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    args = ["serve", "--served-model-name", "smol", "smol-alias", "--api-key", KEY,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
            "--tool-call-parser", "hermes"]  # SmolLM2's template has no tool markup; forced calls use Hermes'
    with running_server(args) as (url, proc, log, health_codes):
        yield url, log, health_codes


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(url) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_health_version_and_startup_log(server):
    url, log, health_codes = server
    assert health_codes[0] == 503 and health_codes[-1] == 200  # the port opens before the weights are in
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    text = open(log).read()
    for needle in ("KV cache", "linears", "served model name(s): smol, smol-alias", "/v1"):
        assert needle in text, needle


def test_chat_greedy_streaming_equals_non_streaming(client, server):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    tokens = httpx.post(server[0] + "/tokenize", json={"messages": QUESTION},
                        headers={"Authorization": f"Bearer {KEY}"}).json()
    assert r.usage.prompt_tokens == tokens["count"] and 0 < r.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model="smol-alias", messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert {c.model for c in chunks} == {"smol-alias"}


def test_completions_stop_logprobs_echo(client):
    prompt = "The capital of France is"
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stop=["."], logprobs=2)
    choice = r.choices[0]
    assert "Paris" in choice.text and "." not in choice.text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "."  # vLLM's field: the stop string that fired
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    # the sampled (greedy) token is the most likely of its alternatives
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-4)
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)
    chunks = [c for c in client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0,
                                                   stop=["."], stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["."]
    kept = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stop=["."],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == choice.text + "." and kept.finish_reason == "stop"
    assert kept.model_extra["stop_reason"] == "."


def test_chat_stop_reason_names_the_stop_or_is_null(client):
    """vLLM's stop_reason on chat choices: the stop string that fired, null for EOS (and for length)."""
    asked = dict(model="smol", messages=QUESTION, max_tokens=30, temperature=0)
    by_eos = client.chat.completions.create(**asked).choices[0]
    assert by_eos.finish_reason == "stop" and by_eos.model_extra["stop_reason"] is None
    by_stop = client.chat.completions.create(**asked, stop=["Paris"]).choices[0]
    assert by_stop.finish_reason == "stop" and by_stop.model_extra["stop_reason"] == "Paris"
    finals = [c.choices[0] for c in client.chat.completions.create(**asked, stop=["Paris"], stream=True)
              if c.choices and c.choices[0].finish_reason]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in finals] == [("stop", "Paris")]


def test_echo_logprobs_score_the_prompt(client, server):
    """The request lm-evaluation-harness sends for loglikelihoods: the prompt's scores agree with what
    decoding gives the same token at the same position."""
    def tokenize(text):
        return httpx.post(server[0] + "/tokenize", json={"prompt": text},
                          headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]

    first = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=1, temperature=0,
                                      logprobs=1)
    ids = tokenize("The capital of France is")
    paris = first.choices[0].logprobs
    tokenized = tokenize("The capital of France is" + paris.tokens[0])
    assert tokenized[:len(ids)] == ids and len(tokenized) == len(ids) + 1
    r = client.completions.create(model="smol", prompt=tokenized, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(tokenized) + 1 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[len(ids)] == paris.tokens[0]
    assert lp.token_logprobs[len(ids)] == pytest.approx(paris.token_logprobs[0], abs=0.05)
    info = httpx.get(server[0] + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    named = httpx.post(server[0] + "/tokenize", json={"prompt": "The capital of France is", "return_token_strs": True},
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    # vLLM's token_strs: the byte-level vocabulary's own strings ("Ġ" for a leading space)
    assert named["tokens"] == ids and named["token_strs"][:3] == ["The", "Ġcapital", "Ġof"]
    assert len(named["token_strs"]) == len(ids) and "token_strs" not in httpx.post(
        server[0] + "/tokenize", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"}).json()


def test_prompt_logprobs_score_and_rank_every_prompt_token(server):
    """vLLM's prompt_logprobs: per prompt token (none for the first) its logprob, its rank and the alternatives,
    the numbers echo's logprobs give; chat has them at the top level; a stream is refused, as in vLLM."""
    def post(path, body):
        return httpx.post(server[0] + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    ids = post("/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    r = post("/v1/completions", {"model": "smol", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                 "prompt_logprobs": 2, "echo": True, "logprobs": 1}).json()
    choice = r["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for position, (token, entry) in enumerate(zip(ids[1:], scored[1:]), 1):
        own = entry[str(token)]
        ranked = sorted(entry.values(), key=lambda v: v["rank"])  # the token itself and the two most likely
        assert [v["rank"] for v in ranked][:2] == [1, 2] and len(entry) == (2 if own["rank"] <= 2 else 3)
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] and ranked[0]["logprob"] >= own["logprob"]
        assert own["logprob"] == choice["logprobs"]["token_logprobs"][position]  # echo's, one alternative
        top = choice["logprobs"]["top_logprobs"][position]  # the token itself first, then the most likely
        assert next(iter(top.values())) == own["logprob"] and len(top) == (1 if own["rank"] == 1 else 2)
    chat = post("/v1/chat/completions", {"model": "smol", "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0})
    prompt_len = chat.json()["usage"]["prompt_tokens"]
    assert len(chat.json()["prompt_logprobs"]) == prompt_len and chat.json()["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat.json()["prompt_logprobs"][1:])
    streamed = post("/v1/chat/completions", {"model": "smol", "messages": QUESTION, "max_tokens": 1,
                                             "prompt_logprobs": 1, "stream": True})
    check_error_shape(streamed, 400, "prompt_logprobs")


def test_n_and_seed_reproducible(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
              temperature=1.0, n=2, seed=1234)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens > 0 and all(texts)


def test_response_format_and_structured_outputs(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,19}$"},
                                               "country": {"type": "string", "pattern": "^[A-Z][a-z]{1,19}$"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name a city in Italy."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    place = json.loads(r.choices[0].message.content)
    assert list(place) == ["city", "country"] and all(isinstance(v, str) for v in place.values())
    stream = client.completions.create(model="smol", prompt="The best season is", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"structured_outputs": {"choice": [" summer", " winter"]}})
    assert "".join(chunk.choices[0].text for chunk in stream) in (" summer", " winter")


def test_responses_api(client):
    """OpenAI's Responses API: the same answer as chat, streamed or not; a follow-up by previous_response_id;
    text.format held to a schema; a forced function call parsed into a function_call item."""
    r = client.responses.create(model="smol", input="What is the capital of France?", max_output_tokens=10,
                                temperature=0)
    chat = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0)
    assert "Paris" in r.output_text and r.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model="smol", input="What is the capital of France?", max_output_tokens=10,
                                          temperature=0, stream=True))
    assert events[-1].response.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    follow = client.responses.create(model="smol", input="And of Italy?", previous_response_id=r.id,
                                     max_output_tokens=10, temperature=0)
    assert "Rome" in follow.output_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,19}$"}},
              "required": ["city"], "additionalProperties": False}
    placed = client.responses.create(model="smol", input="Name a city in Italy.", max_output_tokens=30, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert list(json.loads(placed.output_text)) == ["city"]
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    called = client.responses.create(model="smol", input="What is the weather in Paris?", tools=tools,
                                     tool_choice="required", max_output_tokens=40, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)


def test_models_and_api_key(client, server):
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)
    assert httpx.get(server[0] + "/metrics").status_code == 200  # public without a key


def test_context_length_error(server):
    r = httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smol", "prompt": "hello " * 10, "max_tokens": 600})
    check_error_shape(r, 400, "max_tokens")
    message = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and "600" in message


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_request(server, case):
    _, method, path, body, status, param = case
    r = httpx.request(method, server[0] + path, content=body_bytes(body, "smol", 10 * MAX_MODEL_LEN),
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60)
    check_error_shape(r, status, param)


def test_normal_request_after_malformed(client):
    r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=3, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"


def test_metrics_contents(client, server):
    before = metrics(server[0])
    client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server[0])
    assert after["radiance_generation_tokens_total"] - before["radiance_generation_tokens_total"] == 4
    assert after["radiance_prompt_tokens_total"] > before["radiance_prompt_tokens_total"]
    assert after["radiance_time_to_first_token_seconds_count"] == before["radiance_time_to_first_token_seconds_count"] + 1
    assert after["radiance_e2e_request_latency_seconds_count"] == before["radiance_e2e_request_latency_seconds_count"] + 1
    assert after["radiance_time_per_output_token_seconds_count"] >= 1
    for name in ("radiance_num_requests_running", "radiance_num_requests_waiting", "radiance_kv_cache_usage_perc",
                 "radiance_num_preemptions_total"):
        assert name in after, name


def test_disconnect_frees_kv_blocks(server):
    url = server[0]
    baseline = metrics(url)["radiance_kv_cache_usage_perc"]
    body = json.dumps({"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        seen = metrics(url)
        deadline = time.monotonic() + 30
        while seen["radiance_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = metrics(url)
        assert seen["radiance_num_requests_running"] == 1 and seen["radiance_kv_cache_usage_perc"] > baseline
    finally:
        sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = metrics(url)
        if now["radiance_num_requests_running"] == 0 and now["radiance_kv_cache_usage_perc"] == baseline:
            break
        time.sleep(0.1)
    assert now["radiance_num_requests_running"] == 0
    assert now["radiance_kv_cache_usage_perc"] == baseline
    # far fewer than the 400 tokens asked for were generated: the request was aborted, not run out
    assert now["radiance_generation_tokens_total"] - seen["radiance_generation_tokens_total"] < 300
