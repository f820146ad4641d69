"""min_tokens (vLLM's extra sampling field) through the HTTP layer: it reaches the engine, a bad value is a 400."""

import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, serve_in_thread
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        yield url, engine


def _chat(server, **fields):
    return http(server, "POST", "/v1/chat/completions",
                {"model": "fake", "messages": [{"role": "user", "content": "SAY:hi"}], **fields}, key=None)


def _complete(server, **fields):
    return http(server, "POST", "/v1/completions", {"model": "fake", "prompt": "SAY:hi", **fields}, key=None)


@pytest.mark.parametrize("send", [_chat, _complete])
def test_min_tokens_reaches_the_engine(server, send):
    r = send(server, min_tokens=5, max_tokens=8)
    assert r.status_code == 200, r.text
    assert server[1].requests[-1][2].min_tokens == 5
    for fields in (dict(), dict(min_tokens=None)):  # absent or null: no minimum
        assert send(server, **fields).status_code == 200
        assert server[1].requests[-1][2].min_tokens == 0


@pytest.mark.parametrize("send", [_chat, _complete])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_min_tokens_is_a_400(server, send, stream):
    for bad in (-1, 1.5, "3"):
        check_error_shape(send(server, min_tokens=bad, stream=stream), 400, "min_tokens")
    r = send(server, min_tokens=9, max_tokens=8, stream=stream)
    check_error_shape(r, 400, None)
    assert "min_tokens must be at most max_tokens, got min_tokens 9 > max_tokens 8" in r.json()["error"]["message"]
