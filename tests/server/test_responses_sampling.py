"""/v1/responses takes the sampling fields /v1/chat/completions takes beyond OpenAI's (vLLM's /v1/responses does
too): each reaches the engine as chat's does, and a bad value is the 400 chat gives, naming the field."""

import pytest

from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, responses_store=3) as url:
        yield url, engine


def _respond(server, **fields):
    return http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:hi", **fields}, key=None)


def _chat(server, **fields):
    return http(server, "POST", "/v1/chat/completions",
                {"model": "fake", "messages": [{"role": "user", "content": "SAY:hi"}], **fields}, key=None)


def _engine_params(server):
    return server[1].requests[-1][2]


def test_min_tokens_reaches_the_engine(server):
    r = _respond(server, min_tokens=5, max_output_tokens=8)
    assert r.status_code == 200, r.text
    assert _engine_params(server).min_tokens == 5
    for fields in (dict(), dict(min_tokens=None)):  # absent or null: no minimum
        assert _respond(server, **fields).status_code == 200
        assert _engine_params(server).min_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_min_tokens_is_a_400(server, stream):
    for bad in (-1, 1.5, "3"):
        check_error_shape(_respond(server, min_tokens=bad, stream=stream), 400, "min_tokens")
    r = _respond(server, min_tokens=9, max_output_tokens=8, stream=stream)
    check_error_shape(r, 400, "min_tokens")
    assert "min_tokens must be at most max_output_tokens, got min_tokens 9 > max_output_tokens 8" in r.json()["error"]["message"]


def test_min_tokens_beyond_the_room_left_names_the_responses_field(server):
    """Without max_output_tokens the budget is what the context leaves; a min_tokens over it is a 400 that
    speaks of max_output_tokens (this API's name), not of chat's max_tokens."""
    r = _respond(server, min_tokens=5000)
    check_error_shape(r, 400, "min_tokens")
    message = r.json()["error"]["message"]
    assert "max_output_tokens" in message and "max_tokens" not in message.replace("max_output_tokens", ""), message


# the extra fields as chat takes them, and the SamplingParams value each must give
EXTRA_FIELDS = [
    ("top_k", 7, "top_k", 7),
    ("min_p", 0.2, "min_p", 0.2),
    ("seed", 11, "seed", 11),
    ("stop", ["zz"], "stop", ("zz",)),
    ("stop_token_ids", [5, 6], "stop_token_ids", (5, 6)),
    ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
    ("ignore_eos", True, "ignore_eos", True),
    ("repetition_penalty", 1.3, "repetition_penalty", 1.3),
    ("presence_penalty", 0.5, "presence_penalty", 0.5),
    ("frequency_penalty", -0.5, "frequency_penalty", -0.5),
    ("logit_bias", {"65": 3.0}, "logit_bias", ((65, 3.0),)),
    ("bad_words", ["zz", " hi"], "bad_words", ("zz", " hi")),
    ("allowed_token_ids", [66, 65], "allowed_token_ids", (65, 66)),
    ("cache_salt", "tenant-a", "cache_salt", "tenant-a"),
]


@pytest.mark.parametrize("field,value,param,expected", EXTRA_FIELDS)
def test_chat_sampling_fields_reach_the_engine_as_on_chat(server, field, value, param, expected):
    assert _chat(server, **{field: value}).status_code == 200
    assert getattr(_engine_params(server), param) == expected  # the reference: chat's own
    r = _respond(server, **{field: value})
    assert r.status_code == 200, r.text
    assert getattr(_engine_params(server), param) == expected


def test_skip_special_tokens_reaches_the_engine(server):
    assert _respond(server, skip_special_tokens=False).status_code == 200
    assert _engine_params(server).skip_special_tokens is False
    assert _respond(server).status_code == 200
    assert _engine_params(server).skip_special_tokens is True


@pytest.mark.parametrize("field,bad,param", [
    ("stop", "", "stop"), ("stop", ["a", ""], "stop"), ("logit_bias", {"x": 1.0}, "logit_bias"),
    ("logit_bias", {"5": 500.0}, "logit_bias"), ("stop_token_ids", [1.5], "stop_token_ids[0]"),
    ("ignore_eos", "yes", "ignore_eos"), ("include_stop_str_in_output", 1, "include_stop_str_in_output"),
    ("top_k", -5, "top_k"), ("min_p", 2.0, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("bad_words", "zz", "bad_words"), ("bad_words", [""], "bad_words"),
    ("allowed_token_ids", [], "allowed_token_ids"), ("allowed_token_ids", [1.5], "allowed_token_ids[0]"),
    ("cache_salt", "", "cache_salt"),
])
def test_a_bad_extra_field_is_a_400_naming_it(server, field, bad, param):
    """As chat answers it; stop and logit_bias were refused by the chat request built from this one, which
    reported them as a fault of `input` ("input: Value error, stop strings must be non-empty (as the chat
    request's )")."""
    r = _respond(server, **{field: bad})
    check_error_shape(r, 400, param)
    check_error_shape(_chat(server, **{field: bad}), 400, param)
    assert "input" not in r.json()["error"]["message"] and "Value error" not in r.json()["error"]["message"]


def test_a_stop_string_ends_the_output(server):
    r = _respond(server, input="SAY:hello world", stop=["wor"])
    assert r.json()["output"][0]["content"][0]["text"] == "hello "
