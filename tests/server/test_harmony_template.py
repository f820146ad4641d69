"""The real gpt-oss chat template (tests/server/data, its source on its first line) rendered as requests send
messages: a function without a description, an assistant turn with several calls (the template renders only
`tool_calls[0]`), and the reasoning of earlier turns sent back as `reasoning_content` / `reasoning` (the
template reads `thinking`). Then the same through the server, to the prompt the engine gets."""

import json
from pathlib import Path

import httpx
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.chat_template import render_chat, template_features
from radiance.server.reasoning_parser import HARMONY_MARKERS
from radiance.server.state import ServerState
from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_in_thread

GPT_OSS = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BARE_TIME = {"type": "function", "function": {k: v for k, v in TIME["function"].items() if k != "description"}}
ASK = {"role": "user", "content": "Weather and time in Paris?"}


def call(call_id, name, city):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}


def calls_turn(**extra):
    """An assistant turn with two calls (to two functions) and their replies, as OpenAI clients send it back."""
    return [{"role": "assistant", "content": None, **extra,
             "tool_calls": [call("c1", "get_weather", "Paris"), call("c2", "get_time", "Paris")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"}]


def sent_call(name, city):
    return f'<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{{"city": "{city}"}}<|call|>'


def reply(name, text):
    return f'<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"{text}"<|end|>'


def analysis(text):
    return f"<|start|>assistant<|channel|>analysis<|message|>{text}<|end|>"


def test_the_fixture_is_the_gpt_oss_template():
    assert all(mark in GPT_OSS for mark in ("builtin_tools", "render_typescript_type", "Reasoning: ",
                                            "<|channel|>analysis", "message.tool_calls[0]", "message.thinking"))
    assert template_features(GPT_OSS)["harmony"]
    prompt = render_chat(GPT_OSS, [ASK], reasoning_effort="high")
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: high\n\n" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather and time in Paris?<|end|><|start|>assistant")


def test_a_function_without_a_description_renders():
    """The template writes `"// " + tool.description`; a missing one is an empty comment line, as the template
    writes an empty description (a function with one keeps its comment)."""
    prompt = render_chat(GPT_OSS, [ASK], tools=[WEATHER, BARE_TIME])
    assert ("namespace functions {\n\n"
            "// Weather in a city.\ntype get_weather = (_: {\ncity: string,\n}) => any;\n\n"
            "// \ntype get_time = (_: {\ncity: string,\n}) => any;\n\n"
            "} // namespace functions<|end|>") in prompt


def test_every_call_of_a_turn_renders_each_with_its_reply():
    """One call per assistant message, each reply after its call: the template names a reply after the
    latest call, so two calls then two replies would send `noon` as get_weather's."""
    prompt = render_chat(GPT_OSS, [ASK, *calls_turn()], tools=[WEATHER, TIME])
    assert prompt.endswith("<|start|>user<|message|>Weather and time in Paris?<|end|>"
                           + sent_call("get_weather", "Paris") + reply("get_weather", "sunny")
                           + sent_call("get_time", "Paris") + reply("get_time", "noon") + "<|start|>assistant")


def test_calls_without_their_replies_yet_render_in_order():
    turn = calls_turn()[0]
    prompt = render_chat(GPT_OSS, [ASK, turn], tools=[WEATHER, TIME], add_generation_prompt=False)
    assert prompt.endswith("<|end|>" + sent_call("get_weather", "Paris") + sent_call("get_time", "Paris"))


def test_replies_that_name_no_call_keep_their_place():
    turn, *replies = calls_turn()
    replies = [{k: v for k, v in r.items() if k != "tool_call_id"} for r in replies]
    prompt = render_chat(GPT_OSS, [ASK, turn, *replies], tools=[WEATHER, TIME])
    assert prompt.endswith(sent_call("get_weather", "Paris") + sent_call("get_time", "Paris")
                           + reply("get_time", "sunny") + reply("get_time", "noon") + "<|start|>assistant")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_of_the_calling_turn_is_its_analysis(field):
    """The calls since the last final answer keep their analysis (the template's rule); it goes once, before
    the first call."""
    prompt = render_chat(GPT_OSS, [ASK, *calls_turn(**{field: "Need both tools."})], tools=[WEATHER, TIME])
    assert prompt.endswith("<|end|>" + analysis("Need both tools.") + sent_call("get_weather", "Paris")
                           + reply("get_weather", "sunny") + sent_call("get_time", "Paris") + reply("get_time", "noon")
                           + "<|start|>assistant")


def test_reasoning_and_a_preamble_both_go_to_the_analysis():
    """The template refuses content and thinking on one call message and renders the content (a preamble)
    as analysis: the reasoning goes first, then the preamble."""
    messages = [ASK, *calls_turn(reasoning_content="Need both tools.")]
    messages[1]["content"] = "Checking both."
    prompt = render_chat(GPT_OSS, messages, tools=[WEATHER, TIME])
    assert analysis("Need both tools.\n\nChecking both.") + sent_call("get_weather", "Paris") in prompt
    assert prompt.count("<|channel|>analysis") == 1


def test_reasoning_before_the_last_final_answer_is_dropped():
    """What the template does: analysis of turns before a final answer is not part of the prompt."""
    messages = [ASK, *calls_turn(reasoning_content="Need both tools."),
                {"role": "assistant", "content": "Sunny, noon.", "reasoning_content": "Both replies in."},
                {"role": "user", "content": "And Rome?"}]
    prompt = render_chat(GPT_OSS, messages, tools=[WEATHER, TIME])
    assert "Need both tools." not in prompt and "Both replies in." not in prompt
    assert prompt.endswith(sent_call("get_weather", "Paris") + reply("get_weather", "sunny")
                           + sent_call("get_time", "Paris") + reply("get_time", "noon")
                           + "<|start|>assistant<|channel|>final<|message|>Sunny, noon.<|end|>"
                           "<|start|>user<|message|>And Rome?<|end|><|start|>assistant")


def test_reasoning_of_a_last_final_answer_renders_without_a_generation_prompt():
    messages = [ASK, {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."}]
    prompt = render_chat(GPT_OSS, messages, add_generation_prompt=False)
    assert prompt.endswith(analysis("Easy.") + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")


def test_other_templates_get_the_messages_as_sent():
    """Only harmony templates get the rewrites: a template printing the tools or all calls sees them as sent."""
    messages = [ASK, *calls_turn(reasoning_content="Need both tools.")]
    prompt = render_chat(TEMPLATE, messages, tools=[BARE_TIME], bos_token="")
    assert '"description"' not in prompt
    assert prompt.count("<|assistant|>") == 2  # the turn with both calls, and the generation prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><tool_call>' in prompt


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(chat_template=GPT_OSS, special_tokens=HARMONY_MARKERS, max_model_len=8192)
    state = ServerState(ServerConfig(served_model_name=("gpt-oss",)), engine_factory=lambda: engine)
    state.attach(engine)
    assert (state.reasoning_parser_name, state.tool_parser_name) == ("harmony", "harmony")
    with serve_in_thread(build_app(state)) as url:
        yield url, engine


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_chat_history_with_two_calls_and_reasoning_reaches_the_engine(server, field):
    url, engine = server
    engine.reply = "<|channel|>final<|message|>Sunny, and it is noon.<|return|>"
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-oss", "tools": [WEATHER, BARE_TIME],
        "messages": [ASK, *calls_turn(**{field: "Need both tools."})]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Sunny, and it is noon."
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert "// \ntype get_time = (_: {" in prompt
    assert prompt.endswith(analysis("Need both tools.") + sent_call("get_weather", "Paris")
                           + reply("get_weather", "sunny") + sent_call("get_time", "Paris") + reply("get_time", "noon")
                           + "<|start|>assistant")


def test_responses_follow_up_sends_back_the_reasoning(server):
    """/v1/responses: a reasoning item before the calls goes back as the first call's analysis."""
    url, engine = server
    engine.reply = "<|channel|>final<|message|>Sunny.<|return|>"
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    r = httpx.post(url + "/v1/responses", timeout=30, json={"model": "gpt-oss", "tools": tools, "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two cities."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rainy"}]})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert prompt.endswith(analysis("Two cities.") + sent_call("get_weather", "Paris") + reply("get_weather", "sunny")
                           + sent_call("get_weather", "Rome") + reply("get_weather", "rainy") + "<|start|>assistant")


def test_a_forced_call_follows_the_real_templates_generation_prompt(server):
    """tool_choice naming a function: the real template's prompt, then the call's header as gpt-oss writes it;
    the model's arguments and <|call|> make the tool call."""
    url, engine = server
    engine.reply = '{"city": "Paris"}<|call|>'
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-oss", "tools": [WEATHER, TIME], "messages": [ASK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # a named tool_choice: OpenAI's and vLLM's
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_time", {"city": "Paris"})]
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert prompt.endswith("<|start|>user<|message|>Weather and time in Paris?<|end|><|start|>assistant"
                           "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>")
