"""The model's generation_config.json sampling defaults fill the sampling fields a request leaves out, on every
route (chat, completions, responses), as vLLM's --generation-config auto does; a field the request gives wins,
and --generation-config none keeps OpenAI's defaults."""

from __future__ import annotations

import pytest

from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.config import ConfigError, ServerConfig
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.test_api_fake_engine import http

RECOMMENDED = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "responses": ("/v1/responses", {"input": "hi", "store": False}),
}


def _engine() -> FakeEngine:
    engine = FakeEngine()
    engine.sampling_defaults = RECOMMENDED
    return engine


def _sent(url_engine, route: str, **fields):
    path, body = ROUTES[route]
    r = http(url_engine, "POST", path, {"model": "fake", "max_tokens": 4, **body, **fields}, key=None)
    assert r.status_code == 200, r.text
    return url_engine[1].requests[-1][2]


@pytest.fixture(scope="module")
def served():
    engine = _engine()
    with serve_engine(engine) as url:
        yield url, engine


@pytest.mark.parametrize("route", ROUTES)
def test_omitted_fields_take_the_models_defaults(served, route):
    params = _sent(served, route)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_field_the_request_gives_wins(served, route):
    params = _sent(served, route, temperature=0.0, top_k=0, repetition_penalty=1.0)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, -1, 1.0)  # top_k 0: off
    assert (params.top_p, params.min_p) == (0.9, 0.05)  # the fields it left out still take the defaults


def test_generation_config_none_keeps_openais_defaults():
    engine = _engine()
    with serve_engine(engine, generation_config="none") as url:
        params = _sent((url, engine), "chat")
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        1.0, 1.0, -1, 0.0, 1.0)


def test_the_startup_lines_name_the_defaults_and_a_model_without_them_says_nothing():
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: None)
    state.attach(_engine())
    assert any("temperature 0.6, top_p 0.9, top_k 20" in line for line in state.startup_lines())
    plain = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: None)
    plain.attach(FakeEngine())  # an engine without the attribute: OpenAI's defaults
    assert plain.sampling_defaults == SamplingDefaults()
    assert not any("sampling defaults" in line for line in plain.startup_lines())


def test_the_flag_takes_auto_or_none():
    assert ServerConfig(generation_config="vllm").generation_config == "vllm"  # vLLM's name for none
    with pytest.raises(ConfigError, match="generation_config"):
        ServerConfig(generation_config="bogus")


def test_max_new_tokens_caps_every_request():
    engine = FakeEngine(max_model_len=512)
    engine.sampling_defaults = SamplingDefaults(max_tokens=3)
    with serve_engine(engine) as url:
        server = (url, engine)
        path, body = ROUTES["chat"]
        r = http(server, "POST", path, {"model": "fake", **body}, key=None)  # no max_tokens: the rest, capped
        assert r.status_code == 200 and engine.requests[-1][2].max_tokens == 3
        assert _sent(server, "completions", max_tokens=100).max_tokens == 3  # vLLM caps a request's own too
        assert _sent(server, "completions", max_tokens=2).max_tokens == 2
    with serve_engine(engine, generation_config="vllm") as url:
        assert _sent((url, engine), "completions", max_tokens=100).max_tokens == 100
