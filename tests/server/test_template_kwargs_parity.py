"""chat_template_kwargs on /v1/chat/completions and /tokenize as vLLM's server reads them (its
ChatCompletionRequest.build_chat_params and OnlineRenderer.preprocess_chat / validate_chat_template):
  - add_generation_prompt / continue_final_message: the request's fields are merged over the kwargs, so a kwarg of
    that name changes nothing (it was a 400, or a bare template variable);
  - tools: rendered in place of the request's tools, while tool_choice and the tool-call parser read the request's;
  - documents / reasoning_effort: the request's fields over the kwargs; a null kwarg leaves the variable unset;
  - chat_template: gated by --trust-request-chat-template as the request's field is; used under the field and
    the server's --chat-template;
  - messages (render_chat's own argument) stays a 400 naming it."""

import json

import httpx
import pytest

from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_engine

MSG = [{"role": "user", "content": "SAY:hi"}]
TOOL_A = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_B = {"type": "function", "function": {"name": "kwargs_only_tool", "parameters": {"type": "object"}}}
# prints the variables under test so the prompt shows what the template was given
PROBE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
         "[cfm={{ continue_final_message if continue_final_message is defined else 'unset' }}]"
         "[docs={{ documents | tojson if documents is defined else 'unset' }}]"
         "[effort={{ reasoning_effort if reasoning_effort is defined else 'unset' }}]"
         "[thinking={{ enable_thinking if enable_thinking is defined else 'unset' }}]"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OWN = "{% for m in messages %}SAY:from the kwargs' template{% endfor %}"


def _post(url, path, **body):
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def _chat(url, **fields):
    return _post(url, "/v1/chat/completions", model="fake", **{"messages": MSG, **fields})


def _prompt(engine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def test_generation_prompt_keys_in_the_kwargs_leave_the_fields_in_charge():
    engine = FakeEngine(chat_template=PROBE)
    with serve_engine(engine) as url:
        assert _chat(url).status_code == 200
        plain = _prompt(engine)
        assert plain.endswith("<|assistant|>") and "[cfm=unset]" in plain
        # both in the kwargs (the fields' defaults say otherwise): accepted, the fields decide, as vLLM
        r = _chat(url, chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})
        assert r.status_code == 200, r.text
        assert _prompt(engine) == plain
        # the field off, the kwarg on: no generation prompt
        r = _chat(url, add_generation_prompt=False, chat_template_kwargs={"add_generation_prompt": True})
        assert r.status_code == 200, r.text
        assert not _prompt(engine).endswith("<|assistant|>")
        # the consistency check reads the fields, which decide: both on there is still a 400
        r = _chat(url, continue_final_message=True, chat_template_kwargs={"add_generation_prompt": False})
        assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"], r.text


def test_documents_and_reasoning_effort_fields_over_the_kwargs_and_null_kwargs_unset():
    engine = FakeEngine(chat_template=PROBE)
    kwargs = {"documents": [{"title": "k"}], "reasoning_effort": "low", "enable_thinking": None}
    with serve_engine(engine) as url:
        assert _chat(url, chat_template_kwargs=kwargs).status_code == 200
        prompt = _prompt(engine)
        assert '[docs=[{"title": "k"}]]' in prompt and "[effort=low]" in prompt and "[thinking=unset]" in prompt
        r = _chat(url, chat_template_kwargs=kwargs, documents=[{"title": "f"}], reasoning_effort="high")
        assert r.status_code == 200, r.text
        prompt = _prompt(engine)
        assert '[docs=[{"title": "f"}]]' in prompt and "[effort=high]" in prompt


def test_kwargs_tools_are_rendered_and_the_request_tools_parsed():
    engine = FakeEngine(max_model_len=2048)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    message = [{"role": "user", "content": "SAY:" + call}]
    with serve_engine(engine, tool_call_parser="hermes") as url:
        r = _chat(url, messages=message, tools=[TOOL_A], chat_template_kwargs={"tools": [TOOL_B]})
        assert r.status_code == 200, r.text
        prompt = _prompt(engine)
        assert "kwargs_only_tool" in prompt and prompt.count("get_weather") == 1  # only in the user's message
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        # a forced call names one of the request's tools, not the kwargs' (vLLM validates against request.tools)
        named = {"type": "function", "function": {"name": "get_weather"}}
        rest = [{"role": "user", "content": 'SAY:{"city": "Oslo"}}</tool_call>'}]  # after the forced opening
        r = _chat(url, messages=rest, tools=[TOOL_A], tool_choice=named, chat_template_kwargs={"tools": [TOOL_B]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        only_b = {"type": "function", "function": {"name": "kwargs_only_tool"}}
        r = _chat(url, tools=[TOOL_A], tool_choice=only_b, chat_template_kwargs={"tools": [TOOL_B]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        # without request tools nothing is parsed: the call text is the answer
        r = _chat(url, messages=message, chat_template_kwargs={"tools": [TOOL_B]})
        assert r.status_code == 200 and "kwargs_only_tool" in _prompt(engine)
        assert r.json()["choices"][0]["message"]["content"] == call
        # a null kwarg leaves the request's tools
        assert _chat(url, tools=[TOOL_A], chat_template_kwargs={"tools": None}).status_code == 200
        assert "get_weather" in _prompt(engine)


def test_kwargs_tools_pick_the_models_tool_use_template():
    engine = FakeEngine()
    engine.chat_templates = {"tool_use": "{% for m in messages %}SAY:tool_use template{% endfor %}"}
    with serve_engine(engine) as url:
        r = _chat(url, chat_template_kwargs={"tools": [TOOL_B]})
        assert r.json()["choices"][0]["message"]["content"] == "tool_use template", r.text
        assert _chat(url).json()["choices"][0]["message"]["content"] == "hi"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_kwargs_chat_template_is_refused_unless_trusted(path):
    with serve_engine(FakeEngine()) as url:
        r = _post(url, path, model="fake", messages=MSG, chat_template_kwargs={"chat_template": OWN})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs" and "--trust-request-chat-template" in error["message"]


def test_a_trusted_kwargs_chat_template_is_rendered_under_the_field_and_the_servers():
    field = "{% for m in messages %}SAY:from the field{% endfor %}"
    with serve_engine(FakeEngine(), trust_request_chat_template=True) as url:
        r = _chat(url, chat_template_kwargs={"chat_template": OWN})
        assert r.json()["choices"][0]["message"]["content"] == "from the kwargs' template", r.text
        r = _chat(url, chat_template=field, chat_template_kwargs={"chat_template": OWN})
        assert r.json()["choices"][0]["message"]["content"] == "from the field", r.text
        r = _chat(url, chat_template_kwargs={"chat_template": "{% for m in messages %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    server = "{% for m in messages %}SAY:from the server{% endfor %}"
    with serve_engine(FakeEngine(), trust_request_chat_template=True, chat_template=server) as url:
        r = _chat(url, chat_template_kwargs={"chat_template": OWN})
        assert r.json()["choices"][0]["message"]["content"] == "from the server", r.text


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": "get_weather"}, {"tools": ["x"]},
                                    {"chat_template": 3}, {"chat_template": ""}])
def test_kwargs_the_renderer_cannot_take_are_a_400_naming_them(kwargs):
    with serve_engine(FakeEngine(), trust_request_chat_template=True) as url:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = _post(url, path, model="fake", messages=MSG, chat_template_kwargs=kwargs)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"].startswith("chat_template_kwargs"), r.text
            assert next(iter(kwargs)) in r.json()["error"]["message"], r.text


def test_tokenize_renders_the_kwargs_as_chat_does():
    engine = FakeEngine(max_model_len=2048)
    kwargs = {"tools": [TOOL_B], "add_generation_prompt": False, "chat_template": OWN}
    with serve_engine(engine, trust_request_chat_template=True) as url:
        r = _chat(url, tools=[TOOL_A], chat_template_kwargs=kwargs)
        assert r.status_code == 200, r.text
        tokenized = _post(url, "/tokenize", model="fake", messages=MSG, tools=[TOOL_A],
                          chat_template_kwargs=kwargs).json()
        assert tokenized["tokens"] == engine.requests[-1][1]
        r = _chat(url, tools=[TOOL_A], chat_template_kwargs={"tools": [TOOL_B]})
        tokenized = _post(url, "/tokenize", model="fake", messages=MSG, tools=[TOOL_A],
                          chat_template_kwargs={"tools": [TOOL_B]}).json()
        assert tokenized["tokens"] == engine.requests[-1][1] and "kwargs_only_tool" in _prompt(engine)


def test_odd_kwargs_tools_on_a_harmony_template_are_not_a_500():
    harmony = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
               "{% for t in tools or [] %}[{{ t | tojson }}]{% endfor %}<|channel|>"
               "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    engine = FakeEngine(chat_template=harmony)
    with serve_engine(engine) as url:
        r = _chat(url, chat_template_kwargs={"tools": [{"function": "get_weather"}]})
        assert r.status_code == 200, r.text
        assert json.dumps({"function": "get_weather"}) in _prompt(engine)
