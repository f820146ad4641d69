"""SageMaker's routes (/ping, /invocations), the /v1/models cards in vLLM's shape, and OpenAI's deprecated function
calling (`role: "function"` messages, an assistant's `function_call`) read as tool calling."""

import json

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from radiance.config import ServerConfig
from radiance.server import api
from radiance.server.protocol import ChatCompletionRequest
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine
from tests.server.malformed import MALFORMED, body_bytes, check_error_shape
from tests.server.test_chat_template_and_cli import QWEN_LIKE

KEY = "sk-x"
JSON = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {KEY}"}


def fake_app(engine=None, model_path=None, attach=True, **server_config):
    engine = engine or FakeEngine()
    state = ServerState(ServerConfig(**server_config), engine_factory=lambda: engine, model_path=model_path)
    if attach:
        state.attach(engine)
    return api.build_app(state), engine


@pytest.fixture
def client():
    app, engine = fake_app(served_model_name=("fake",))
    with TestClient(app) as c:
        c.engine = engine
        yield c


def prompt_of(engine) -> str:
    """The text of the prompt the engine was last asked to continue."""
    return engine.tokenizer.decode(engine.requests[-1][1])


# ---------------------------------------------------------------- /ping


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_does_and_is_public(method):
    app, _ = fake_app(api_key=KEY)
    with TestClient(app) as client:
        assert client.request(method, "/ping").status_code == 200
        assert client.request(method, "/ping").content == client.get("/health").content == b""
    loading, _ = fake_app(attach=False)
    r = TestClient(loading).request(method, "/ping")  # no lifespan: the model never starts loading
    check_error_shape(r, 503, None)
    assert r.json()["error"]["message"] == "model loading"


# ---------------------------------------------------------------- /invocations


def strip_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_invocations_with_messages_is_a_chat_completion(client):
    body = {"model": "fake", "messages": [{"role": "user", "content": "SAY:hello"}], "logprobs": True}
    via, direct = client.post("/invocations", json=body), client.post("/v1/chat/completions", json=body)
    assert via.status_code == direct.status_code == 200
    assert via.json()["object"] == "chat.completion" and via.json()["choices"][0]["message"]["content"] == "hello"
    assert strip_ids(via.json()) == strip_ids(direct.json())


def test_invocations_with_prompt_is_a_completion(client):
    body = {"prompt": "SAY:hi there", "max_tokens": 5, "echo": True}
    via, direct = client.post("/invocations", json=body), client.post("/v1/completions", json=body)
    assert via.json()["object"] == "text_completion" and via.json()["choices"][0]["text"] == "SAY:hi therehi th"
    assert strip_ids(via.json()) == strip_ids(direct.json())


@pytest.mark.parametrize("body,kind", [
    ({"messages": [{"role": "user", "content": "SAY:abc"}], "stream": True}, "chat.completion.chunk"),
    ({"prompt": "SAY:abc", "stream": True}, "text_completion"),
])
def test_invocations_streams_as_the_route_it_serves(client, body, kind):
    with client.stream("POST", "/invocations", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {kind}
    text = "".join(c["choices"][0]["delta"].get("content") or "" if kind.startswith("chat")
                   else c["choices"][0]["text"] for c in chunks)
    assert text == "abc"


def test_a_body_with_both_fields_is_a_chat_completion_as_in_vllm(client):
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "SAY:chat"}], "prompt": "SAY:x"})
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["content"] == "chat"


# every malformed chat / completions request: /invocations answers it exactly as the route it stands for
ROUTED = [c for c in MALFORMED if c[2] in ("/v1/chat/completions", "/v1/completions")
          and isinstance(c[3], dict) and ("messages" in c[3] or "prompt" in c[3])]


@pytest.mark.parametrize("case", ROUTED, ids=[c[0] for c in ROUTED])
def test_invocations_errors_are_the_routes_own(client, case):
    _, _, path, body, status, param = case
    data = body_bytes(body, "fake", 10_000)
    via, direct = client.post("/invocations", content=data, headers=JSON), client.post(path, content=data, headers=JSON)
    check_error_shape(via, status, param)
    assert (via.status_code, via.json()) == (direct.status_code, direct.json())


def test_the_routed_cases_cover_field_and_whole_request_errors():
    names = {c[0] for c in ROUTED}
    assert {"bad role", "temperature a bool", "unknown model", "max_tokens too large"} <= names, names


@pytest.mark.parametrize("data,headers", [
    (b"{not json", JSON), (b"[1, 2]", JSON), (b'"hello"', JSON),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), {"Content-Type": "text/plain"}),
])
def test_a_body_that_is_no_json_object_is_answered_as_on_the_v1_routes(client, data, headers):
    via = client.post("/invocations", content=data, headers=headers)
    direct = client.post("/v1/chat/completions", content=data, headers=headers)
    check_error_shape(via, 400, None)
    assert via.json() == direct.json()


@pytest.mark.parametrize("body", [{}, {"model": "fake"}, {"input": "hello"}, {"Messages": []}])
def test_a_body_of_no_served_kind_is_a_400(client, body):
    r = client.post("/invocations", json=body)
    check_error_shape(r, 400, None)
    assert r.json()["error"]["message"] == ("an /invocations body is a chat completion request (with messages) or a "
                                            "completion request (with prompt): it has neither")
    assert not client.engine.requests


def test_invocations_needs_the_api_key_as_the_v1_routes_do():
    app, engine = fake_app(api_key=KEY)
    body = {"messages": [{"role": "user", "content": "SAY:ok"}]}
    with TestClient(app) as client:
        for path in ("/invocations", "/v1/chat/completions"):
            check_error_shape(client.post(path, json=body), 401, None)
            check_error_shape(client.post(path, json=body, headers={"Authorization": "Bearer nope"}), 401, None)
        assert not engine.requests
        r = client.post("/invocations", json=body, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_invocations_while_loading_is_the_routes_503():
    app, _ = fake_app(attach=False)
    client = TestClient(app)
    for path, body in (("/invocations", {"prompt": "x"}), ("/v1/completions", {"prompt": "x"})):
        check_error_shape(client.post(path, json=body), 503, None)


# ---------------------------------------------------------------- /v1/models


def test_the_model_card_has_vllms_fields():
    app, _ = fake_app(model_path="/models/my-model", served_model_name=("fake", "alias"))
    with TestClient(app) as client:
        cards = client.get("/v1/models").json()["data"]
        one = client.get("/v1/models/alias").json()
    assert [c["id"] for c in cards] == ["fake", "alias"]
    card = cards[0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (card["object"], card["owned_by"], card["root"], card["parent"], card["max_model_len"]) == \
        ("model", "radiance", "/models/my-model", None, 512)
    [perm] = card["permission"]
    assert perm["id"].startswith("modelperm-") and perm["object"] == "model_permission"
    assert perm["created"] == card["created"] and isinstance(perm["created"], int)
    assert {k: v for k, v in perm.items() if k not in ("id", "object", "created")} == {
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    assert one == cards[1]  # the one-model route gives the listed card, permission id and all
    assert cards[0]["permission"][0]["id"] != cards[1]["permission"][0]["id"]


def test_the_cards_root_is_the_model_not_the_name_it_is_served_under():
    """No model path (the embedded model, or an engine given directly): the model's own name, not the alias."""
    app, _ = fake_app(served_model_name=("alias",))
    with TestClient(app) as client:
        card = client.get("/v1/models").json()["data"][0]
    assert (card["id"], card["root"]) == ("alias", "fake-model")


def test_while_loading_the_card_has_no_context_length_yet():
    app, _ = fake_app(attach=False, served_model_name=("fake",))
    card = TestClient(app).get("/v1/models").json()["data"][0]
    assert card["max_model_len"] is None and card["root"] == "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------- role "function"

LEGACY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"role": "function", "name": "get_weather", "content": "22C and sunny"},
    {"role": "user", "content": "SAY:thanks"},
]


def test_a_function_message_is_a_tool_message_with_its_name():
    req = ChatCompletionRequest.model_validate({"messages": LEGACY})
    dumped = [m.model_dump(exclude_none=True) for m in req.messages]
    assert dumped[1] == {"role": "assistant", "tool_calls": [{"id": "call_fn1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert dumped[2] == {"role": "tool", "content": "22C and sunny", "name": "get_weather", "tool_call_id": "call_fn1"}
    # revalidated (the /tokenize route builds a chat request of its validated messages): the same
    assert [m.model_dump(exclude_none=True) for m in ChatCompletionRequest(messages=req.messages).messages] == dumped


def test_function_call_details():
    def roles(messages):
        req = ChatCompletionRequest.model_validate({"messages": messages})
        return [m.model_dump(exclude_none=True) for m in req.messages]

    # OpenAI's function message may have a null content; a result of no call, or of another function, gets no id
    assert roles([{"role": "function", "name": "f", "content": None}]) == [{"role": "tool", "content": "", "name": "f"}]
    call = {"role": "assistant", "function_call": {"name": "f", "arguments": {"x": 1}}}
    assert roles([call, {"role": "function", "name": "g", "content": "r"}])[1] == \
        {"role": "tool", "content": "r", "name": "g"}
    # the result of the latest call gets its id; a call's arguments sent as an object are its JSON
    assert roles([call, {"role": "function", "name": "f", "content": "r"}]) == [
        {"role": "assistant", "tool_calls": [{"id": "call_fn0", "type": "function",
                                              "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "r", "name": "f", "tool_call_id": "call_fn0"}]
    # a client's own tool_call_id is kept
    assert roles([call, {"role": "function", "name": "f", "content": "r", "tool_call_id": "mine"}])[1][
        "tool_call_id"] == "mine"
    # refused, as OpenAI refuses them, rather than read one way or dropped: a function message without its name,
    # function_call beside tool_calls or on another role's message
    both = {**call, "tool_calls": [{"id": "c1", "function": {"name": "h", "arguments": "{}"}}]}
    for messages, says in (([call, {"role": "function", "content": "r"}], "needs the name"),
                           ([both], "function_call is an assistant message's field"),
                           ([{"role": "user", "content": "hi", "function_call": call["function_call"]}],
                            "function_call is an assistant message's field")):
        with pytest.raises(ValidationError, match=says):
            roles(messages)


def test_a_function_message_is_no_longer_a_400(client):
    r = client.post("/v1/chat/completions", json={"messages": LEGACY})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "thanks"
    prompt = prompt_of(client.engine)  # the fake engine's template: <|role|>content, calls as <tool_call>JSON
    assert ('<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|end|>'
            '<|tool|>22C and sunny<|end|>') in prompt
    # the tokenizer route renders them the same way
    tokens = client.post("/tokenize", json={"messages": LEGACY}).json()["tokens"]
    assert client.engine.tokenizer.decode(tokens) == prompt


def test_a_qwen_like_template_renders_the_call_and_its_result():
    """Qwen's templates drop a message whose role they do not know: as a tool message the result is rendered."""
    app, engine = fake_app(FakeEngine(chat_template=QWEN_LIKE))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={"messages": LEGACY}).status_code == 200
    prompt = prompt_of(engine)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>22C and sunny</tool_response><|im_end|>') in prompt


def test_a_template_matching_results_to_calls_by_id_gets_one_id_for_both():
    ids = "{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}{{ c.id }}{% endfor %}" \
          "{{ m.tool_call_id or '' }};{% endfor %}SAY:ok"
    app, engine = fake_app(FakeEngine(chat_template=ids))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={"messages": LEGACY}).status_code == 200
    assert prompt_of(engine).startswith("user:;assistant:call_fn1;tool:call_fn1;user:;")


def test_the_embedded_models_template_renders_a_function_message():
    from radiance.checkpoint import embedded_model_path, open_checkpoint

    template = open_checkpoint(embedded_model_path()).chat_template
    app, engine = fake_app(FakeEngine(chat_template=template))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={"messages": LEGACY}).status_code == 200
    prompt = prompt_of(engine)
    assert "<|im_start|>tool\n22C and sunny<|im_end|>\n<|im_start|>user\nSAY:thanks<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
