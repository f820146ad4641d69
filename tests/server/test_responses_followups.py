"""/v1/responses against the scripted engine: a stream that fails after it started ends with `response.failed`
(and is stored as failed), and `include` values are checked against the ones OpenAI's API defines."""

import json

import httpx
import openai
import pytest

from radiance.engine.async_engine import EngineDeadError
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http


class DyingEngine(FakeEngine):
    """A reply with `DIE` in it: the engine loop dies after two tokens (EngineDeadError, as a real one raises)."""

    async def generate(self, request_id, prompt_token_ids, params):
        sent = 0
        async for out in super().generate(request_id, prompt_token_ids, params):
            if sent == 2 and "DIE" in self.tokenizer.decode(prompt_token_ids):
                raise EngineDeadError("the engine loop died")
            sent += 1
            yield out


@pytest.fixture(scope="module")
def server():
    engine = DyingEngine()
    with serve_engine(engine, responses_store=5) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def _stream_events(server, body: dict) -> tuple[list[str], list[dict]]:
    """The stream's SSE event names and data objects."""
    with httpx.stream("POST", server[0] + "/v1/responses", json={"model": "fake", "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    return names, [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("say,message", [("abcdFAIL", "internal server error (RuntimeError)"),
                                         ("abcdDIE", "the engine loop died; restart the server")])
def test_a_stream_failing_mid_way_ends_with_response_failed(server, say, message):
    """The engine raising mid-generation (any exception, or EngineDeadError) ended the stream with an `error`
    event only, and the response was never stored. Now the open item closes incomplete and `response.failed`
    carries the response, status failed, with OpenAI's {code, message}; a GET reads the same back."""
    names, events = _stream_events(server, {"input": f"SAY:{say}"})
    assert [e["type"] for e in events] == names and names[0] == "response.created"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "error" not in names and names[-1] == "response.failed"
    assert names[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
    assert failed["error"] == {"code": "server_error", "message": message}
    assert failed["output"][0]["status"] == "incomplete"
    sent = 2 if "DIE" in say else 3  # the tokens the engine made before it raised
    assert failed["output"][0]["content"][0]["text"] == say[:sent] and failed["usage"]["output_tokens"] == sent
    stored = http(server, "GET", f"/v1/responses/{failed['id']}", key=None)
    assert stored.status_code == 200 and stored.json() == failed
    assert _stream_events(server, {"input": "SAY:fine"})[0][-1] == "response.completed"  # still serving


def test_the_openai_client_reads_a_failed_stream(client):
    events = list(client.responses.create(model="fake", input="SAY:abcdFAIL", stream=True, store=False))
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and last.response.store is False


def test_a_non_stream_failure_is_an_openai_shaped_500_and_not_stored(server):
    r = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:abcdFAIL"}, key=None)
    check_error_shape(r, 500, None)
    assert "internal server error" in r.json()["error"]["message"]
    ok = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:fine"}, key=None)
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "fine"


@pytest.mark.parametrize("value", ["file_search_call.results", "web_search_call.results",
                                   "web_search_call.action.sources", "code_interpreter_call.outputs",
                                   "computer_call_output.output.image_url", "message.input_image.image_url",
                                   "message.output_text.logprob", "everything"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_include_value_not_served_is_a_400_naming_it(server, value, stream):
    """Such values were silently ignored: a client asking for search results got none and no word why."""
    r = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:hi", "stream": stream,
                                               "include": ["message.output_text.logprobs", value]}, key=None)
    check_error_shape(r, 400, "include")
    assert repr(value) in r.json()["error"]["message"]


def test_the_include_values_served_are_accepted(client):
    r = client.responses.create(model="fake", input="SAY:ab", include=["message.output_text.logprobs",
                                                                        "reasoning.encrypted_content"])
    assert r.status == "completed" and [e.token for e in r.output[0].content[0].logprobs] == ["a", "b"]
