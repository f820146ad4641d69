"""tool_choice "none" as vLLM's server serves it: the request's tools are rendered into the prompt (the model knows
they exist; the model's tool_use template where it has one, as any render with tools) and no call is parsed, forced
or held out of the answer: a call the model writes anyway is content, finish_reason "stop". vLLM's
--exclude-tools-when-tool-choice-none (ServerConfig.exclude_tools_when_tool_choice_none) leaves them out instead,
with the model's default template. /v1/responses and /tokenize render the same way."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.server.cli import configs_from_args, register
from tests.server.fake_engine import FakeEngine, serve_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "SAY:" + CALL}]


@pytest.fixture(scope="module")
def default():
    engine = FakeEngine()
    with serve_engine(engine, tool_call_parser="hermes") as url:
        yield url, engine


@pytest.fixture(scope="module")
def excluding():
    engine = FakeEngine()
    with serve_engine(engine, tool_call_parser="hermes", exclude_tools_when_tool_choice_none=True) as url:
        yield url, engine


def post(url, path, body):
    r = httpx.post(url + path, json={"model": "fake", **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def last_prompt(engine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def sse(response) -> list[dict]:
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_none_renders_the_tools_by_default_and_not_with_the_flag(default, excluding):
    (url, engine), (flag_url, flag_engine) = default, excluding
    post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    prompt = last_prompt(engine)
    assert "<|tools|>" in prompt and '"get_weather"' in prompt
    post(flag_url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert "<|tools|>" not in last_prompt(flag_engine)
    # the flag touches "none" alone: "auto" renders the tools either way
    post(flag_url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"})
    assert "<|tools|>" in last_prompt(flag_engine)


@pytest.mark.parametrize("exclude, template", [(False, "tool_use template"), (True, "default template")])
def test_none_picks_the_tool_use_template_unless_the_flag_excludes_the_tools(exclude, template):
    engine = FakeEngine(chat_template="{% for m in messages %}SAY:default template{% endfor %}")
    engine.chat_templates = {"tool_use": "{% for m in messages %}SAY:tool_use template{% endfor %}"}
    with serve_engine(engine, tool_call_parser="hermes", exclude_tools_when_tool_choice_none=exclude) as url:
        r = post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
        assert r.json()["choices"][0]["message"]["content"] == template


@pytest.mark.parametrize("fixture", ["default", "excluding"])
def test_a_call_the_model_writes_under_none_is_content(fixture, request):
    url, engine = request.getfixturevalue(fixture)
    body = {"messages": MESSAGES, "tools": TOOLS}
    # the parser is live: under "auto" the same answer is a call
    auto = post(url, "/v1/chat/completions", body).json()["choices"][0]
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["tool_calls"]
    choice = post(url, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()["choices"][0]
    assert choice["message"]["content"] == CALL and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    chunks = sse(post(url, "/v1/chat/completions", {**body, "tool_choice": "none", "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == CALL
    assert not any(d.get("tool_calls") for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]


def test_none_holds_no_strict_call_in_a_grammar(default):
    url, engine = default
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    post(url, "/v1/chat/completions", {"messages": MESSAGES, "tools": strict, "tool_choice": "none"})
    assert engine.requests[-1][2].structured_output is None and "<|tools|>" in last_prompt(engine)


def test_responses_none_renders_the_tools_and_answers_a_message(default, excluding):
    (url, engine), (flag_url, flag_engine) = default, excluding
    body = {"input": "SAY:" + CALL, "tools": RESPONSES_TOOLS, "tool_choice": "none"}
    out = post(url, "/v1/responses", body).json()
    assert "<|tools|>" in last_prompt(engine)
    assert engine.requests[-1][2].structured_output is None  # Responses functions are strict: not held under none
    assert [item["type"] for item in out["output"]] == ["message"]
    assert out["output"][0]["content"][0]["text"] == CALL and out["tool_choice"] == "none"
    post(flag_url, "/v1/responses", body)
    assert "<|tools|>" not in last_prompt(flag_engine)


def test_tokenize_counts_the_tools_under_none_as_the_chat_route_renders_them(default, excluding):
    for url, engine in (default, excluding):
        body = {"messages": MESSAGES, "tools": TOOLS}
        counts = {choice: post(url, "/tokenize", {**body, "tool_choice": choice}).json()["count"]
                  for choice in ("auto", "none")}
        chat = post(url, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()["usage"]
        assert counts["none"] == chat["prompt_tokens"]
        if engine is default[1]:
            assert counts["none"] == counts["auto"]  # the same prompt: tools in it
        else:
            assert counts["none"] < counts["auto"]


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_the_flag_is_parsed_from_the_serve_command_line():
    _, server = configs_from_args(parse(["serve", "--exclude-tools-when-tool-choice-none"]))
    assert server.exclude_tools_when_tool_choice_none is True
    _, server = configs_from_args(parse(["serve", "--exclude-tools-when-tool-choice-none", "false"]))
    assert server.exclude_tools_when_tool_choice_none is False
    assert ServerConfig().exclude_tools_when_tool_choice_none is False  # vLLM's default: the tools are rendered
