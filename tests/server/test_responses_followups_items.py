"""/v1/responses against the scripted engine: `truncation: "auto"` drops the oldest conversation items that
do not fit, and `GET /v1/responses/{id}/input_items` lists a stored response's input items (order, after, limit,
include), through the openai client where it can."""

import openai
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http

# The fake template renders a user turn as <|user|>TEXT<|end|> (15 bytes + TEXT: one token per byte)
CONVERSATION = [{"role": "user", "content": "A" * 50}, {"role": "assistant", "content": "B" * 50},
                {"role": "user", "content": "C" * 50}, {"role": "assistant", "content": "D" * 50},
                {"role": "user", "content": "SAY:ok"}]
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}


@pytest.fixture(scope="module")
def small():
    """A 200-token context."""
    engine = FakeEngine(max_model_len=200)
    with serve_engine(engine, responses_store=5) as url:
        yield url, engine


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, responses_store=5) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _respond(server, **fields):
    return http(server, "POST", "/v1/responses", {"model": "fake", **fields}, key=None)


def _prompt(server) -> str:
    engine = server[1]
    return engine.tokenizer.decode(engine.requests[-1][1])


def test_truncation_auto_drops_the_oldest_items_that_do_not_fit(small):
    """"auto" was accepted and did nothing: the request got the same over-context 400 as "disabled"."""
    fields = {"input": CONVERSATION, "instructions": "Be brief.", "max_output_tokens": 10}
    check_error_shape(_respond(small, **fields), 400, "input")  # disabled, the default: 333 prompt tokens
    assert _respond(small, **fields).json()["error"]["code"] == "context_length_exceeded"
    r = _respond(small, **fields, truncation="auto")
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto" and r.json()["output"][0]["content"][0]["text"] == "ok"
    prompt = _prompt(small)
    assert prompt == ("<s><|system|>Be brief.<|end|><|assistant|>" + "D" * 50
                      + "<|end|><|user|>SAY:ok<|end|><|assistant|>")
    # the fewest dropped: with the newest dropped user turn back the prompt would not fit
    assert len(prompt) + 10 <= 200 < len(prompt) + len("<|user|><|end|>" + "C" * 50) + 10
    assert r.json()["usage"]["input_tokens"] == len(prompt)


def test_truncation_auto_keeps_a_call_with_its_output(small):
    """A function call and its output are dropped together: an output whose call is gone may break a template
    (dropping item by item, the call went first and its output stayed)."""
    items = [{"role": "user", "content": "A" * 50}, CALL,
             {"type": "function_call_output", "call_id": "call_1", "output": "E" * 60},
             {"role": "user", "content": "SAY:ok"}]
    r = _respond(small, input=items, instructions="Be brief.", max_output_tokens=10, truncation="auto")
    assert r.status_code == 200, r.text
    assert _prompt(small) == "<s><|system|>Be brief.<|end|><|user|>SAY:ok<|end|><|assistant|>"


def test_truncation_auto_drops_the_previous_responses_turns_first(small):
    first = _respond(small, input="SAY:" + "F" * 60)
    assert first.status_code == 200, first.text
    r = _respond(small, input="SAY:ok", previous_response_id=first.json()["id"], max_output_tokens=10,
                 truncation="auto")
    assert r.status_code == 200, r.text
    assert _prompt(small) == "<s><|assistant|>" + "F" * 60 + "<|end|><|user|>SAY:ok<|end|><|assistant|>"


def test_truncation_auto_cannot_drop_the_newest_item(small):
    r = _respond(small, input=[{"role": "user", "content": "hi"}, {"role": "user", "content": "SAY:" + "x" * 300}],
                 truncation="auto")
    check_error_shape(r, 400, "input")
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "truncation auto" in error["message"], error


def test_input_items_of_a_response_and_its_follow_up(client):
    """The endpoint did not exist (404 for every id)."""
    items = [{"role": "developer", "content": "Be terse."}, {"id": "msg_mine", "role": "user", "content": "q"},
             CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SAY:one"}]}]
    first = client.responses.create(model="fake", input=items)
    listed = client.responses.input_items.list(first.id).data  # newest first: OpenAI's default order
    assert [i.type for i in listed] == ["message", "function_call_output", "function_call", "message", "message"]
    assert listed[3].id == "msg_mine" and listed[3].content[0].type == "input_text" and listed[3].content[0].text == "q"
    assert listed[4].role == "developer" and listed[2].call_id == "call_1" and listed[1].output == "sunny"
    assert len({i.id for i in listed}) == 5 and all(i.id for i in listed)
    second = client.responses.create(model="fake", input="SAY:two", previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id, order="asc").data
    # its context: the first response's input items and output, then its own input
    assert [i.id for i in listed[:6]] == [i.id for i in client.responses.input_items.list(first.id, order="asc")
                                          ][:5] + [first.output[0].id]
    assert listed[5].role == "assistant" and listed[5].content[0].text == "one"
    assert listed[6].role == "user" and listed[6].content[0].text == "SAY:two" and len(listed) == 7


def test_input_items_pages(client, server):
    r = client.responses.create(model="fake", input=[{"role": "user", "content": f"SAY:{i}"} for i in range(5)])
    ids = [i.id for i in client.responses.input_items.list(r.id, order="asc")]
    assert len(ids) == 5
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=2)] == ids  # follows `after`
    page = http(server, "GET", f"/v1/responses/{r.id}/input_items?limit=2&after={ids[-1]}", key=None).json()
    assert page == {"object": "list", "data": page["data"], "first_id": ids[-2], "last_id": ids[-3], "has_more": True}
    page = http(server, "GET", f"/v1/responses/{r.id}/input_items?order=asc&limit=3&after={ids[1]}", key=None).json()
    assert [i["id"] for i in page["data"]] == ids[2:] and page["has_more"] is False
    page = client.responses.input_items.list(r.id, include=["message.output_text.logprobs"])
    assert [i.id for i in page.data] == ids[::-1]


@pytest.mark.parametrize("query,status,param", [
    ("order=up", 400, "order"), ("limit=0", 400, "limit"), ("limit=101", 400, "limit"), ("limit=x", 400, "limit"),
    ("after=msg_nothing", 400, "after"), ("include=file_search_call.results", 400, "include"),
    ("include[]=web_search_call.results", 400, "include"), ("include=nonsense", 400, "include"),
])
def test_input_items_bad_queries_are_400s(server, query, status, param):
    response_id = _respond(server, input="SAY:x").json()["id"]
    check_error_shape(http(server, "GET", f"/v1/responses/{response_id}/input_items?{query}", key=None), status, param)


def test_input_items_of_no_stored_response_is_a_404(server):
    check_error_shape(http(server, "GET", "/v1/responses/resp_nothing/input_items", key=None), 404, "response_id")
    unstored = _respond(server, input="SAY:x", store=False).json()["id"]
    check_error_shape(http(server, "GET", f"/v1/responses/{unstored}/input_items", key=None), 404, "response_id")
    deleted = _respond(server, input="SAY:x").json()["id"]
    assert http(server, "DELETE", f"/v1/responses/{deleted}", key=None).status_code == 200
    check_error_shape(http(server, "GET", f"/v1/responses/{deleted}/input_items", key=None), 404, "response_id")
