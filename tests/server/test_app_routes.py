"""The app build_app assembles: the routes each router module serves, and the one place an unexpected exception is
answered (RequestMiddleware; errors.py registers no handler for Exception: Starlette runs one outside the
middleware, where it would see only the middleware's own failures, and re-raise them to uvicorn)."""

import logging
import warnings

import pytest
from fastapi.testclient import TestClient

from radiance.config import ServerConfig
from radiance.server import api
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine
from tests.server.malformed import check_error_shape

ROUTES = {
    "/health": {"get", "head"}, "/ping": {"get", "post"}, "/version": {"get"}, "/metrics": {"get"},
    "/invocations": {"post"},
    "/v1/models": {"get"}, "/v1/models/{name}": {"get"},
    "/v1/chat/completions": {"post"}, "/v1/completions": {"post"}, "/v1/responses": {"post"},
    "/v1/responses/{response_id}": {"get", "delete"}, "/v1/responses/{response_id}/input_items": {"get"},
    "/tokenize": {"post"}, "/detokenize": {"post"}, "/tokenizer_info": {"get"},
}


def fake_app(**server_config):
    engine = FakeEngine()
    state = ServerState(ServerConfig(served_model_name=("fake",), **server_config), engine_factory=lambda: engine)
    state.attach(engine)
    return api.build_app(state)


def test_the_app_serves_the_routes_of_its_router_modules():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # /health's GET and HEAD share an operation id
        paths = fake_app().openapi()["paths"]
    assert {path: set(methods) for path, methods in paths.items()} == ROUTES


def error_500s(client) -> float:
    line = 'radiance_request_errors_total{model_name="fake",status="500"} '
    found = [row for row in client.get("/metrics").text.splitlines() if row.startswith(line)]
    return float(found[0][len(line):]) if found else 0.0


def test_an_unexpected_exception_is_answered_by_the_middleware_alone(caplog):
    """A route that raised: an OpenAI-shaped 500, logged once by the middleware, counted once, and the next request
    served. TestClient re-raises what reaches Starlette's outermost handler: nothing does."""
    app = fake_app()

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    assert Exception not in app.exception_handlers and 500 not in app.exception_handlers
    with TestClient(app) as client, caplog.at_level(logging.ERROR):
        r = client.get("/broken")
        check_error_shape(r, 500, None)
        assert r.json()["error"] == {"message": "internal server error (RuntimeError)",
                                     "type": "internal_server_error", "param": None, "code": None}
        assert r.headers["x-request-id"]
        logged = [rec for rec in caplog.records if "internal error while serving" in rec.getMessage()]
        assert [(rec.name, rec.getMessage()) for rec in logged] == [("radiance.server.api",
                                                                     "internal error while serving /broken")]
        assert error_500s(client) == 1.0
        assert client.get("/version").status_code == 200


def test_a_failure_in_the_key_check_is_answered_the_same_way(monkeypatch, caplog):
    def failing(_self, _scope):
        raise ValueError("a bug in the middleware")

    app = fake_app(api_key="sk-x")
    with TestClient(app) as client, caplog.at_level(logging.ERROR):
        monkeypatch.setattr(api.RequestMiddleware, "_authorized", failing)
        r = client.get("/v1/models", headers={"Authorization": "Bearer sk-x"})
        monkeypatch.undo()
        check_error_shape(r, 500, None)
        assert r.json()["error"]["message"] == "internal server error (ValueError)"
        assert error_500s(client) == 1.0
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-x"}).status_code == 200
        assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("key,status,counted", [(None, 200, 0.0), ("sk-x", 401, 1.0)])
def test_a_missing_key_is_a_counted_401(key, status, counted):
    with TestClient(fake_app(api_key=key)) as client:
        r = client.get("/v1/models")
        assert r.status_code == status
        line = 'radiance_request_errors_total{model_name="fake",status="401"} '
        found = [row for row in client.get("/metrics").text.splitlines() if row.startswith(line)]
        assert (float(found[0][len(line):]) if found else 0.0) == counted


def test_the_param_of_a_whole_request_check_is_the_field_its_message_names_first():
    from radiance.server.errors import field_named_first
    from radiance.server.protocol import ChatCompletionRequest, CompletionRequest
    from radiance.server.protocol_responses import ResponsesRequest

    assert field_named_first("top_logprobs needs logprobs", ChatCompletionRequest) == "top_logprobs"
    assert field_named_first("echo is not supported", ChatCompletionRequest, CompletionRequest) == "echo"
    assert field_named_first("max_output_tokens is too large", ResponsesRequest) == "max_output_tokens"
    assert field_named_first("max_output_tokens is too large", ChatCompletionRequest) is None
    assert field_named_first("the prompt is too long", ChatCompletionRequest) is None
    assert field_named_first("", ChatCompletionRequest) is None
