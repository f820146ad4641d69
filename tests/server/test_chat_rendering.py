"""Chat prompts as transformers renders them (render_jinja_template, the same template and messages): a continued
final message cut where the template wrote its end, reasoning under any of its names, content parts joined as vLLM
joins them. A differential hunt found prompts cut inside the template's end-of-turn markup, or before the whole
conversation, when the final message's text also appeared after it."""

from __future__ import annotations

import httpx
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_engine

# a template that trims each message, as Llama 3's, Mistral's and Gemma's do
TRIMMING = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n\n{{ m.content | trim }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# a template that prints an assistant turn's reasoning, as Qwen3's does
REASONING = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
             "</think>{% endif %}{{ m.content }}<|end|>{% endfor %}")


@pytest.fixture(scope="module")
def url():
    with serve_engine(FakeEngine(), trust_request_chat_template=True) as base:
        yield base


def prompt_text(url: str, body: dict) -> str:
    """The prompt the server would send for a chat body (/tokenize renders it as /v1/chat/completions does)."""
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return bytes(r.json()["tokens"]).decode("utf-8")  # the fake tokenizer's ids are the prompt's bytes


def reference(template: str, messages: list[dict], **kwargs) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, bos_token="<s>", eos_token="</s>",
                                        **kwargs)
    return rendered[0]


@pytest.mark.parametrize("template", [TEMPLATE, TRIMMING], ids=["keeps spaces", "trims"])
@pytest.mark.parametrize("final", ["Roses are", "\n", "e", "<", " ", "end", "one two ", "1.\n", ""])
def test_a_continued_final_message_is_cut_where_transformers_cuts_it(url, template, final):
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": final}]
    ours = prompt_text(url, {"messages": messages, "chat_template": template, "add_generation_prompt": False,
                             "continue_final_message": True})
    assert ours == reference(template, messages, continue_final_message=True)


def test_a_template_that_never_writes_the_content_refuses_to_continue_it(url):
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Go"},
                                                         {"role": "assistant", "content": "Sure"}],
                                            "chat_template": "{% for m in messages %}<|{{ m.role }}|>{% endfor %}",
                                            "add_generation_prompt": False, "continue_final_message": True},
                   timeout=30)
    assert r.status_code == 400 and "does not write the final message's content" in r.json()["error"]["message"]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_sent_back_under_any_name_reaches_the_template(url, field):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Sunny.", field: "look outside"}]
    ours = prompt_text(url, {"messages": messages, "chat_template": REASONING, "add_generation_prompt": False})
    assert "<think>look outside</think>Sunny." in ours
    assert ours == reference(REASONING, messages)


def test_text_parts_are_joined_by_newlines(url):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert "<|user|>Hello\nworld<|end|>" in prompt_text(url, {"messages": [{"role": "user", "content": parts}]})


def test_tool_call_arguments_sent_back_as_an_object_render_as_their_json_string_does(url):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    as_string = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = lambda c: [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,  # noqa: E731
                                                                  "tool_calls": [c]}]
    assert prompt_text(url, {"messages": history(call)}) == prompt_text(url, {"messages": history(as_string)})


def test_a_tag_in_another_message_is_no_place_to_cut(url):
    """A template that drops the assistant's content: only the user's text holds the tag's words."""
    r = httpx.post(url + "/tokenize", json={
        "messages": [{"role": "user", "content": "say CONTINUE_FINAL_MESSAGE_TAG now"},
                     {"role": "assistant", "content": "Sure"}],
        "chat_template": "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'user' %}{{ m.content }}{% endif %}"
                         "{% endfor %}", "add_generation_prompt": False, "continue_final_message": True}, timeout=30)
    assert r.status_code == 400 and "does not write the final message's content" in r.json()["error"]["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "nowhere"}}])
def test_tokenize_refuses_a_tool_choice_its_tools_cannot_serve(url, tool_choice):
    """As the chat route answers it (was a 500 from the chat request built inside the route)."""
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                            "tool_choice": tool_choice}, timeout=30)
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]


def test_responses_input_parts_are_joined_as_chat_joins_them():
    """The same conversation renders alike through /v1/responses and /v1/chat/completions."""
    from radiance.server.protocol_responses import input_messages

    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}]
    (message,) = input_messages([{"type": "message", "role": "user", "content": parts}])
    assert message["content"] == "Hello\nworld"
