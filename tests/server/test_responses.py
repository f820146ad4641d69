"""/v1/responses against the scripted engine, through the openai client (which parses every item and event
into its own types): text, instructions, streaming events, function calls and their outputs, reasoning,
stored responses and previous_response_id, truncation, text.format, logprobs."""

import json

import httpx
import openai
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, serve_engine, serve_in_thread

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, responses_store=3) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def last_prompt(server) -> str:
    engine = server[1]
    return engine.tokenizer.decode(engine.requests[-1][1])


def create(client, **kw):
    return client.responses.create(model="fake", **kw)


def without_ids(items: list) -> list:
    """Items as dicts with their generated ids blanked (two runs of one request differ only there)."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d.pop("id", None)
        d.pop("call_id", None)
        out.append(d)
    return out


def test_text_with_instructions(client, server):
    r = create(client, input="SAY:Hello there", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.model == "fake"
    assert r.output_text == "Hello there" and r.id.startswith("resp_")
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.instructions == "Be brief."
    assert last_prompt(server).startswith("<s><|system|>Be brief.<|end|><|user|>SAY:Hello there<|end|><|assistant|>")
    assert r.usage.input_tokens == len(server[1].requests[-1][1]) and r.usage.output_tokens == len("Hello there")
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_build_the_same_response(client):
    events = list(create(client, input="SAY:Streamed text", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == "Streamed text" and len(deltas) > 1
    final = events[-1].response
    assert final.output_text == "Streamed text" and final.usage.output_tokens == len("Streamed text")
    assert without_ids(final.output) == without_ids(create(client, input="SAY:Streamed text").output)


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_then_its_output(client, server, stream):
    if stream:
        events = list(create(client, input="SAY:Checking." + CALL, tools=TOOLS, stream=True))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = create(client, input="SAY:Checking." + CALL, tools=TOOLS)
    assert [i.type for i in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert r.output[0].content[0].text == "Checking." and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert '"name": "get_weather"' in last_prompt(server)  # the tools reached the template
    # the client sends the call back with its output (stateless, as agents do)
    follow = create(client, tools=TOOLS, input=[
        {"role": "user", "content": "SAY:done"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status == "completed" and follow.output_text == "done"
    assert last_prompt(server).endswith(
        "<|assistant|>" + CALL + "<|end|><|tool|>sunny<|end|><|assistant|>")


def test_a_call_cut_by_max_output_tokens_is_incomplete(client):
    cut = CALL.index('"Paris"') + 3  # inside the arguments
    r = create(client, input="SAY:" + CALL, tools=TOOLS, max_output_tokens=cut)
    assert r.status == "incomplete" and [i.type for i in r.output] == ["function_call"]
    assert r.output[0].status == "incomplete" and r.output[0].arguments.endswith('"Pa')
    whole = create(client, input="SAY:" + CALL, tools=TOOLS, max_output_tokens=len(CALL) - 2)  # end tag cut
    assert whole.output[0].status == "completed" and json.loads(whole.output[0].arguments) == {"city": "Paris"}


def test_forced_named_call(client, server):
    r = create(client, input='SAY:{"city": "Rome"}}</tool_call>', tools=TOOLS,
               tool_choice={"type": "function", "name": "get_weather"})
    assert [i.type for i in r.output] == ["function_call"] and json.loads(r.output[0].arguments) == {"city": "Rome"}
    assert last_prompt(server).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_reasoning_item_comes_first(client):
    kw = dict(input="SAY:the plan</think>\n\nthe answer", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = create(client, **kw)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "the plan" and r.output_text == "the answer"
    assert r.usage.output_tokens_details.reasoning_tokens == len("the plan")
    events = list(create(client, stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "the plan"
    assert without_ids(events[-1].response.output) == without_ids(r.output)


def test_previous_response_id_continues_the_conversation(client, server):
    first = create(client, input="SAY:first answer", instructions="Only here.")
    second = create(client, input="SAY:second answer", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "second answer"
    assert last_prompt(server).startswith(  # the instructions do not carry over
        "<s><|user|>SAY:first answer<|end|><|assistant|>first answer<|end|><|user|>SAY:second answer<|end|>")
    assert client.responses.retrieve(first.id).output_text == "first answer"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = create(client, input="SAY:x", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_newest(client):
    ids = [create(client, input=f"SAY:{i}").id for i in range(4)]  # capacity 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).output_text == "3"


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_leaves_it_incomplete(client, stream):
    if stream:
        events = list(create(client, input="SAY:Hello there", max_output_tokens=3, stream=True))
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = create(client, input="SAY:Hello there", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hel" and r.output[0].status == "incomplete"


def test_text_format_and_sampling_reach_the_engine(client, server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = create(client, input="SAY:{}", temperature=0.3, top_p=0.9, max_output_tokens=7,
               text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    params = server[1].requests[-1][2]
    assert json.loads(params.structured_output.json) == schema
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.9, 7)
    assert r.text.format.type == "json_schema" and r.temperature == 0.3
    create(client, input="SAY:{}", text={"format": {"type": "json_object"}})
    assert server[1].requests[-1][2].structured_output.json_object


def test_logprobs_when_included(client):
    r = create(client, input="SAY:ab", include=["message.output_text.logprobs"], top_logprobs=1)
    lp = r.output[0].content[0].logprobs
    assert [e.token for e in lp] == ["a", "b"] and all(e.logprob == -0.5 for e in lp)
    assert len(lp[0].top_logprobs) == 1
    assert not create(client, input="SAY:ab").output[0].content[0].logprobs


def test_an_engine_failure_mid_stream_is_an_error_event(server):
    with httpx.stream("POST", server[0] + "/v1/responses", json={"model": "fake", "input": "SAY:abcdFAIL",
                                                                 "stream": True}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][len("data: "):])
    assert last["type"] == "response.failed" and "internal server error" in last["response"]["error"]["message"]
    assert "[DONE]" not in lines[-1]


def test_function_tools_are_strict_unless_they_say_not(client, server):
    create(client, input="SAY:x", tools=TOOLS)
    assert "get_weather" in server[1].requests[-1][2].structured_output.grammar  # OpenAI's default: strict
    create(client, input="SAY:x", tools=[{**TOOLS[0], "strict": False}])
    assert server[1].requests[-1][2].structured_output is None


def test_reasoning_effort_reaches_the_template():
    """reasoning_effort (chat) and reasoning.effort (Responses): "none" / "minimal" turn thinking off where
    the request's chat_template_kwargs do not say otherwise; every value reaches the template; a value
    outside OpenAI's list is a 400 naming the field."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
                "[{{ reasoning_effort }}]{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}")
    engine = FakeEngine(chat_template=template)
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        server = (url, engine)
        messages = [{"role": "user", "content": "SAY:hi"}]
        for effort, kwargs, ending in [(None, None, "[]<think>"), ("high", None, "[high]<think>"),
                                       ("none", None, "[none]"), ("minimal", None, "[minimal]"),
                                       ("minimal", {"enable_thinking": True}, "[minimal]<think>")]:
            body = {"chat_template_kwargs": kwargs} if kwargs else {}
            extra = {"reasoning_effort": effort} if effort else {}
            client.chat.completions.create(model="fake", messages=messages, extra_body=body, **extra)
            assert last_prompt(server).endswith(ending), (effort, kwargs, last_prompt(server))
        r = client.responses.create(model="fake", input="SAY:hi", reasoning={"effort": "none"})
        assert last_prompt(server).endswith("[none]") and r.reasoning.effort == "none"
        client.responses.create(model="fake", input="SAY:hi")
        assert last_prompt(server).endswith("[]<think>")
        for path, body, param in [("/v1/chat/completions", {"messages": messages, "reasoning_effort": "extreme"},
                                   "reasoning_effort"),
                                  ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning")]:
            r = httpx.post(url + path, json={"model": "fake", **body})
            assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text
