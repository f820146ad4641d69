"""A chat template that fails on a request's messages is the client's 400 with the template's own words,
whatever Python error the template hit; templates written for transformers' helpers render here too."""

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.chat_template import TemplateError, check_template, render_chat
from radiance.server.state import ServerState
from radiance.errors import ConfigError
from tests.server.fake_engine import FakeEngine, serve_in_thread

USER = [{"role": "user", "content": "SAY:x"}]


@pytest.mark.parametrize("template, words", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ range(10**9) | list }}", "Range too big"),
    ("{{ messages | map(attribute='content') | join | int // 0 }}", "ZeroDivisionError"),
])
def test_any_error_inside_the_template_is_a_template_error(template, words):
    with pytest.raises(TemplateError, match=words):
        render_chat(template, USER)


def test_a_failing_template_is_a_400_over_http():
    engine = FakeEngine(chat_template="{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}"
                                      "{% endif %}{{ (messages | length) // (messages | length - 1) }}")
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        def post(messages):
            return httpx.post(url + "/v1/chat/completions", timeout=20,
                              json={"model": "fake", "messages": messages, "max_tokens": 4})
        refused = post([{"role": "system", "content": "be brief"}])
        assert refused.status_code == 400 and refused.json()["error"]["message"] == "no system"
        crashed = post(USER)  # 1 // 0 inside the template: the request's fault, not a server error
        assert crashed.status_code == 400, crashed.text
        assert "ZeroDivisionError" in crashed.json()["error"]["message"]
        assert post(USER + [{"role": "assistant", "content": "y"}]).status_code == 200


def test_generation_blocks_of_transformers_templates_render_their_body():
    # transformers marks the assistant's tokens with {% generation %}: the block renders as its body
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
                "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")
    check_template(template)
    assert render_chat(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) \
        == "<u>hi</u><a>yo</a>"


def test_check_template_names_the_line_of_a_syntax_error():
    with pytest.raises(ConfigError, match=r"does not parse: .*\(line 2\)"):
        check_template("ok\n{% for %}")
