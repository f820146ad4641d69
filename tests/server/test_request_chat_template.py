"""vLLM's per-request `chat_template`: refused unless the server trusts request templates (a template is code the
server runs), rendered in place of the model's when it does; was ignored without a word (logged)."""

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine

OWN = "{% for m in messages %}SAY:from the request's template, {{ m.content }}{% endfor %}"


def _chat(url, **fields):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_a_request_template_is_refused_by_default_and_the_server_keeps_serving():
    with serve_engine(FakeEngine()) as url:
        r = _chat(url, chat_template=OWN)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
        assert _chat(url).status_code == 200


def test_a_trusted_server_renders_the_request_template():
    engine = FakeEngine()
    with serve_engine(engine, trust_request_chat_template=True) as url:
        r = _chat(url, chat_template=OWN)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "from the request's template, hi"
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "chat_template": OWN}, timeout=30).json()
        assert tokenized["count"] == r.json()["usage"]["prompt_tokens"]
        # the model's template again for the next request (the request's is not kept)
        assert _chat(url).json()["choices"][0]["message"]["content"] != "from the request's template, hi"


@pytest.mark.parametrize("template, param", [
    ("{% for m in messages %}", "chat_template"),  # does not parse
    ("{{ raise_exception('no') }}", "messages"),  # parses, fails on these messages
    ("", "chat_template"),  # empty: a template that renders nothing
])
def test_a_broken_request_template_is_a_400(template, param):
    with serve_engine(FakeEngine(), trust_request_chat_template=True) as url:
        r = _chat(url, chat_template=template)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert _chat(url).status_code == 200
