"""Conformance follow-ups, each against OpenAI's documented behaviour (vLLM's where OpenAI says nothing):
a named tool_choice finishes "stop"; /v1/responses logprobs only with their include; a missing stored
response is a 404 invalid_request_error; a streaming stored response reads back in_progress while it runs."""

import json

import httpx
import openai
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SLOW = "SLOW " + "abcdefghij" * 3  # 35 tokens of 50 ms: the stream runs while the test reads it back


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, responses_store=4) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def chat_finish(client, say: str, stream: bool, **kw) -> tuple[list, str]:
    """(tool calls as (name, arguments dict), finish_reason) of one chat answer, streamed or not."""
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "SAY:" + say}],
                                       stream=stream, **kw)
    if stream:
        chunks = list(r)
        deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in deltas]
        [reason] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return calls, reason
    choice = r.choices[0]
    return [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []], \
        choice.finish_reason


# 1. tool_choice naming a function: OpenAI answers finish_reason "stop" (their note: "if we forced the model to
# call one of our functions, the finish_reason will actually be 'stop'"), vLLM too ("tool_calls" for auto or
# required, "stop" for named); streamed and not alike.

@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_finishes_with_stop(client, stream):
    calls, reason = chat_finish(client, '{"city": "Rome"}}</tool_call>', stream, tools=TOOLS, tool_choice=NAMED)
    assert calls == [("get_weather", {"city": "Rome"})]
    assert reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_the_model_chose_still_finishes_with_tool_calls(client, stream):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    calls, reason = chat_finish(client, call, stream, tools=TOOLS)
    assert calls == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"


# 2. /v1/responses: logprobs only with include ["message.output_text.logprobs"] (OpenAI's: top_logprobs alone
# answers logprobs []; vLLM's is_include_output_logprobs gates on the include alone).

@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_without_the_include_returns_no_logprobs(client, server, stream):
    if stream:
        with client.responses.stream(model="fake", input="SAY:ab", top_logprobs=2) as events:
            deltas = [e for e in events if e.type == "response.output_text.delta"]
            r = events.get_final_response()
        assert deltas and all(not getattr(e, "logprobs", None) for e in deltas)
    else:
        r = client.responses.create(model="fake", input="SAY:ab", top_logprobs=2)
    assert r.output_text == "ab" and r.output[0].content[0].logprobs == []
    assert server[1].requests[-1][2].logprobs is None  # none asked of the engine either


def test_top_logprobs_with_the_include_returns_them(client):
    r = client.responses.create(model="fake", input="SAY:ab", top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lp = r.output[0].content[0].logprobs
    assert [e.token for e in lp] == ["a", "b"] and all(len(e.top_logprobs) == 2 for e in lp)


# 3. A response id the store does not have: 404 with type invalid_request_error (OpenAI's 404 bodies for a
# missing object, vLLM's `Response with id '...' not found.`), on every route that names one.

@pytest.mark.parametrize("method,path", [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                                         ("GET", "/v1/responses/resp_nope/input_items")])
def test_a_missing_response_is_a_404_invalid_request_error(server, method, path):
    r = httpx.request(method, server[0] + path, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_id"
    assert "resp_nope" in err["message"]


def test_the_openai_client_reads_the_404_as_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_nope")
    assert info.value.body["type"] == "invalid_request_error"


# 4. GET /v1/responses/{id} while its stream runs (store true): the response, status in_progress (OpenAI's),
# replaced by the final one when the stream ends; one deleted meanwhile stays deleted.

def _stream_events(url: str, body: dict):
    """The events of a streamed /v1/responses request, as they come."""
    with httpx.stream("POST", url + "/v1/responses", json={"model": "fake", "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: "):])


def test_a_streaming_stored_response_reads_back_in_progress_then_completed(server):
    url = server[0]
    events = _stream_events(url, {"input": "SAY:" + SLOW})
    created = next(events)
    assert created["type"] == "response.created"
    response_id = created["response"]["id"]
    r = httpx.get(f"{url}/v1/responses/{response_id}", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["status"], body["output"], body["usage"]) == (response_id, "in_progress", [], None)
    items = httpx.get(f"{url}/v1/responses/{response_id}/input_items", timeout=30).json()
    assert [item["type"] for item in items["data"]] == ["message"]
    rest = list(events)
    assert rest[-1]["type"] == "response.completed"
    final = httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).json()
    assert final["status"] == "completed" and final == rest[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == SLOW


def test_a_response_deleted_while_it_streams_stays_deleted(server):
    url = server[0]
    events = _stream_events(url, {"input": "SAY:" + SLOW})
    response_id = next(events)["response"]["id"]
    r = httpx.delete(f"{url}/v1/responses/{response_id}", timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert list(events)[-1]["type"] == "response.completed"  # the stream goes on to its end
    assert httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).status_code == 404


def test_an_unstored_streaming_response_is_not_readable(server):
    url = server[0]
    events = _stream_events(url, {"input": "SAY:" + SLOW, "store": False})
    response_id = next(events)["response"]["id"]
    assert httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).status_code == 404
    list(events)
    assert httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).status_code == 404


def test_a_follow_up_to_a_response_still_in_progress_is_refused(server):
    url = server[0]
    events = _stream_events(url, {"input": "SAY:" + SLOW})
    response_id = next(events)["response"]["id"]
    r = httpx.post(url + "/v1/responses", timeout=30,
                   json={"model": "fake", "input": "SAY:next", "previous_response_id": response_id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    list(events)
    r = httpx.post(url + "/v1/responses", timeout=30,
                   json={"model": "fake", "input": "SAY:next", "previous_response_id": response_id})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "next"


def test_a_stream_that_fails_reads_back_failed(server):
    url = server[0]
    events = _stream_events(url, {"input": "SAY:abcdFAIL"})
    response_id = next(events)["response"]["id"]
    assert list(events)[-1]["type"] == "response.failed"
    assert httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).json()["status"] == "failed"
