"""/v1/responses input that the server cannot serve is an OpenAI-shaped 400 naming `input` (it was a 500 for some
malformed items), and what OpenAI's API accepts is accepted (tool_choice without tools)."""

import pytest

from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http

USER = {"role": "user", "content": "SAY:hi"}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine, responses_store=3) as url:
        yield url, engine


def _respond(server, **fields):
    return http(server, "POST", "/v1/responses", {"model": "fake", **fields}, key=None)


def _prompt(server) -> str:
    engine = server[1]
    return engine.tokenizer.decode(engine.requests[-1][1])


@pytest.mark.parametrize("item,where", [
    ({"type": "reasoning", "summary": "a plan"}, "input[0].summary"),
    ({"type": "reasoning", "content": 5}, "input[0].content"),
    ({"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}, "input[0].summary[0]"),
    ({"type": "reasoning", "content": [None]}, "input[0].content[0]"),
    ({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}, "input[0].content[0]"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_item_is_a_400_not_a_500(server, item, where, stream):
    r = _respond(server, input=[item, USER], stream=stream)
    check_error_shape(r, 400, "input")
    assert r.json()["error"]["message"].startswith(where), r.json()


def test_a_reasoning_item_reaches_the_next_assistant_turn(server):
    """Its reasoning text goes with the assistant message after it: the content when it has some (our own
    reasoning items), else the summary (OpenAI's); not both, which repeated the thinking."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
                "{% endif %}{{ m.content }}<|end|>{% endfor %}<|assistant|>")
    engine = FakeEngine(chat_template=template)
    with serve_engine(engine) as url:
        here = (url, engine)
        for reasoning, seen in [({"content": [{"type": "reasoning_text", "text": "thought"}],
                                  "summary": [{"type": "summary_text", "text": "summary"}]}, "[thought]"),
                                ({"summary": [{"type": "summary_text", "text": "sum"}, {"type": "summary_text",
                                                                                        "text": "mary"}]}, "[summary]"),
                                ({"summary": [], "encrypted_content": "opaque"}, "")]:
            r = _respond(here, input=[{"role": "user", "content": "q"}, {"type": "reasoning", **reasoning},
                                      {"role": "assistant", "content": "a"}, USER])
            assert r.status_code == 200, r.text
            assert f"<|assistant|>{seen}a<|end|>" in _prompt(here)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_choice_without_tools_is_accepted(server, choice):
    """OpenAI's API takes tool_choice "auto" (its default, which clients send as is) or "none" without tools;
    the chat request built from it refused "auto" with "input: Value error, tool_choice needs tools (as the
    chat request's )"."""
    for stream in (False, True):
        r = _respond(server, input="SAY:hi", tool_choice=choice, stream=stream)
        assert r.status_code == 200, r.text
    assert _respond(server, input="SAY:hi", tool_choice=choice).json()["tool_choice"] == choice


def test_tool_choice_required_without_tools_is_still_a_400(server):
    check_error_shape(_respond(server, input="SAY:hi", tool_choice="required"), 400, "tool_choice")


def test_input_with_no_message_says_so(server):
    r = _respond(server, input=[{"type": "reasoning", "summary": []}])
    check_error_shape(r, 400, "input")
    message = r.json()["error"]["message"]
    assert "no message" in message and "chat request" not in message, message


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_previous_response_id_has_openais_code(server, stream):
    """OpenAI answers it with code previous_response_not_found, which clients read to resend the whole
    conversation; a response created with store false is unknown too."""
    unstored = _respond(server, input="SAY:x", store=False).json()["id"]
    for previous in ("resp_nope", unstored):
        r = _respond(server, input="SAY:hi", previous_response_id=previous, stream=stream)
        check_error_shape(r, 400, "previous_response_id")
        assert r.json()["error"]["code"] == "previous_response_not_found"


def test_a_lone_surrogate_is_blamed_on_the_field_holding_it(server):
    """It was found in the rendered prompt, and the 400 named `input` for one in `instructions`."""
    for body, param in [('{"model": "fake", "input": "SAY:hi", "instructions": "be \\ud800 brief"}', "instructions"),
                        ('{"model": "fake", "input": [{"role": "user", "content": "\\ud800"}]}', "input")]:
        r = http(server, "POST", "/v1/responses", body.encode(), key=None)
        check_error_shape(r, 400, param)
        assert r.json()["error"]["message"].startswith(f"{param} holds a lone UTF-16 surrogate"), r.json()


@pytest.mark.parametrize("chat_message, message", [
    ("messages[0].content must be a string", "input[0].content must be a string"),
    ("max_tokens 9 does not fit; use max_tokens 4 or less", "max_output_tokens 9 does not fit; use max_output_tokens 4 or less"),
    # a value quoted in the message keeps a field name it merely contains (it was rewritten: "max_output_tokens_x")
    ("stop string 'max_tokens_x' is too long", "stop string 'max_tokens_x' is too long"),
    ("unknown key 'all_messages'", "unknown key 'all_messages'"),
])
def test_chat_field_names_become_the_responses_names_as_whole_words(chat_message, message):
    from radiance.server.serving_responses import _responses_names

    assert _responses_names(chat_message) == message
