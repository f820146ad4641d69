"""gpt-oss tool calls in the harmony format: a message to `functions.NAME` becomes an OpenAI tool call. The
harmony reasoning parser hands such messages to the harmony tool-call parser (fed whole and in every chunking,
as ChoiceStream does), the parser is picked from the template, and chat / Responses requests through the
scripted engine give tool_calls; forced calls (tool_choice required / named) end the prompt with the
call's header and hold the rest to the tools; a history with calls renders."""

import json

import httpx
import openai
import pytest
from xgrammar.testing import _is_grammar_accept_string

from radiance.config import ServerConfig
from radiance.errors import ConfigError
from radiance.server.api import build_app
from radiance.server.reasoning_parser import HARMONY_MARKERS, HarmonyReasoningParser
from radiance.server.state import ServerState
from radiance.server.tool_parsers import HarmonyToolParser, ParseDelta
from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_in_thread
from tests.server.test_harmony import HARMONY_TEMPLATE

ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
CALL_PARIS = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city":"Paris"}<|call|>')
CALL_ROME = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}<|call|>'
PARIS, ROME = ("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Rome"}')

CASES = [  # output text, reasoning, content, calls [(name, arguments)]
    pytest.param(CALL_PARIS.removeprefix("<|start|>assistant"), "", "", [PARIS], id="one-call"),
    pytest.param(CALL_ROME.removeprefix("<|start|>assistant"), "", "", [ROME], id="recipient-before-channel"),
    pytest.param(ANALYSIS + CALL_PARIS, "Need the weather.", "", [PARIS], id="call-after-analysis"),
    pytest.param(ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
                 + CALL_PARIS, "Need the weather.", "Let me look that up.", [PARIS], id="preamble-then-call"),
    pytest.param(ANALYSIS + CALL_PARIS + CALL_ROME, "Need the weather.", "", [PARIS, ROME], id="two-calls"),
    pytest.param(ANALYSIS + CALL_PARIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
                 "Need the weather.", "Sunny.", [PARIS], id="call-then-answer"),
    pytest.param(ANALYSIS + "<|start|>assistant to=functions.get_wea", "Need the weather.", "", [],
                 id="cut-in-the-header"),  # no whole name: no call, and no markup as content
]


def parse(chunks):
    """Reasoning, content and calls, the harmony parsers chained as ChoiceStream chains them."""
    reasoning_parser, tool_parser = HarmonyReasoningParser(), HarmonyToolParser([])
    reasoning, tools = "", ParseDelta()
    for delta in [reasoning_parser.feed(chunk) for chunk in chunks] + [reasoning_parser.finish()]:
        reasoning += delta.reasoning
        tools += tool_parser.feed(delta.content)
        for message in delta.function_messages:
            tools += tool_parser.function_message(message)
    tools += tool_parser.finish()
    return reasoning, tools.content, [(c.name, c.arguments) for c in tools.tool_calls]


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_harmony_calls_whole_and_any_chunking_agree(text, reasoning, content, calls):
    assert parse([text]) == (reasoning, content, calls)
    assert parse(list(text)) == (reasoning, content, calls)
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]]) == (reasoning, content, calls), cut
    assert not any(mark in reasoning + content for mark in ("<|", "|>", "to=", "functions."))


def test_a_call_cut_off_in_its_arguments_is_incomplete():
    parser = HarmonyReasoningParser()
    parser.feed(ANALYSIS + CALL_PARIS[:-len('y":"Paris"}<|call|>')])
    [message] = parser.finish().function_messages
    assert (message.name, message.arguments, message.complete) == ("get_weather", '{"cit', False)


def test_a_call_comes_out_when_its_message_ends():
    parser = HarmonyReasoningParser()
    assert parser.feed(CALL_PARIS[:-len("<|call|>")]).function_messages == []
    [message] = parser.feed("<|call|>").function_messages
    assert (message.name, message.arguments, message.complete) == ("get_weather", '{"city":"Paris"}', True)


@pytest.mark.parametrize("tool_flag,reasoning_flag,template,want", [
    ("auto", "auto", HARMONY_TEMPLATE, "harmony"),
    ("auto", "none", HARMONY_TEMPLATE, None),  # nothing reads the headers that name a recipient
    ("hermes", "auto", HARMONY_TEMPLATE, "hermes"),
    ("auto", "auto", TEMPLATE, "hermes"),
    ("none", "auto", HARMONY_TEMPLATE, None),
])
def test_harmony_tool_parser_picked_with_the_harmony_reasoning_parser(tool_flag, reasoning_flag, template, want):
    state = ServerState(ServerConfig(tool_call_parser=tool_flag, reasoning_parser=reasoning_flag), lambda: None)
    state.attach(FakeEngine(chat_template=template))
    assert state.tool_parser_name == want


def test_harmony_tool_parser_without_the_harmony_reasoning_parser_is_a_config_error():
    state = ServerState(ServerConfig(tool_call_parser="harmony", reasoning_parser="none"), lambda: None)
    with pytest.raises(ConfigError, match="harmony reasoning parser"):
        state.attach(FakeEngine(chat_template=HARMONY_TEMPLATE))


# gpt-oss's template in small: the tools in a developer message, a call as a message to functions.NAME with
# its arguments as JSON, a tool's reply as a message from functions.NAME (the last call's name) as a JSON string
TOOLS_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for tool in tools %}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% set last_call = namespace(name=none) %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and 'tool_calls' in m %}{% set call = m.tool_calls[0].function %}"
    "{{ '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}"
    "{{ call.arguments | tojson }}<|call|>{% set last_call.name = call.name %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}{% if last_call.name is none %}{{ raise_exception('a tool reply without a call') }}"
    "{% endif %}{{ '<|start|>functions.' + last_call.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{ m.content | tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(chat_template=TOOLS_TEMPLATE, special_tokens=HARMONY_MARKERS)
    state = ServerState(ServerConfig(served_model_name=("gpt-oss",)), engine_factory=lambda: engine)
    state.attach(engine)
    assert (state.reasoning_parser_name, state.tool_parser_name) == ("harmony", "harmony")
    with serve_in_thread(build_app(state)) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine


def ask(client, messages=None, **kw):
    return client.chat.completions.create(model="gpt-oss", messages=messages or [{"role": "user", "content": "X?"}],
                                          **kw)


def calls_of(tool_calls):
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


def streamed(client, **kw):
    """(reasoning, content, calls, finish reasons) gathered from a streamed answer."""
    chunks = [c.choices[0] for c in ask(client, stream=True, **kw) if c.choices]
    reasoning = "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.delta.tool_calls or ()]
    return reasoning, content, calls, [c.finish_reason for c in chunks if c.finish_reason]


def test_chat_call_after_analysis(server):
    _, client, engine = server
    engine.reply = ANALYSIS + CALL_PARIS
    choice = ask(client, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."


def test_chat_stream_call_after_analysis(server):
    _, client, engine = server
    engine.reply = ANALYSIS + CALL_PARIS
    reasoning, content, calls, reasons = streamed(client, tools=TOOLS)
    assert (reasoning, content, reasons) == ("Need the weather.", "", ["tool_calls"])
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert [call.index for call in calls] == [0] and calls[0].id.startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_preamble_and_two_calls(server, stream):
    _, client, engine = server
    engine.reply = (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
                    + CALL_PARIS + CALL_ROME)
    if stream:
        reasoning, content, calls, reasons = streamed(client, tools=TOOLS)
        reason = reasons[-1]
        assert [call.index for call in calls] == [0, 1]
    else:
        choice = ask(client, tools=TOOLS).choices[0]
        reasoning, content, calls, reason = (choice.message.model_extra["reasoning_content"], choice.message.content,
                                             choice.message.tool_calls, choice.finish_reason)
    assert (reasoning, content, reason) == ("Need the weather.", "Checking both.", "tool_calls")
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_chat_without_tools_keeps_a_call_body_as_content(server):
    _, client, engine = server
    engine.reply = ANALYSIS + CALL_PARIS
    choice = ask(client).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        '{"city":"Paris"}', None, "stop")


def test_responses_give_reasoning_then_a_function_call(server):
    _, client, engine = server
    engine.reply = ANALYSIS + CALL_PARIS
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"],
              "strict": False}]
    r = client.responses.create(model="gpt-oss", input="X?", tools=tools)
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_weather", {"city": "Paris"})


OPENING = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
PROMPT_REQUIRED = "<|start|>assistant<|channel|>commentary to=functions."
NAMED = {"type": "function", "function": {"name": "get_weather"}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {}}}  # takes nothing


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_ends_the_prompt_with_its_header(server, tool_choice, stream):
    """tool_choice required / named: the prompt ends with the call's header (up to the function's name with
    "required", which the model then writes), the arguments are held to the function's parameter schema, and
    the answer is that call."""
    _, client, engine = server
    header = "" if tool_choice == "required" else OPENING.format("get_weather").removeprefix(PROMPT_REQUIRED)
    engine.reply = ("get_weather <|constrain|>json<|message|>" if tool_choice == "required" else "") \
        + '{"city": "Paris"}<|call|>'
    response = ask(client, tools=TOOLS + [NOW], tool_choice=tool_choice, stream=stream)
    reason = "tool_calls" if tool_choice == "required" else "stop"  # a named call ends "stop" (OpenAI's, vLLM's)
    if stream:
        chunks = list(response)
        calls = [(c.function.name, c.function.arguments) for chunk in chunks for c in chunk.choices[0].delta.tool_calls
                 or []]
        assert [name for name, _ in calls if name] == ["get_weather"]
        assert json.loads("".join(arguments or "" for _, arguments in calls)) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == reason
    else:
        choice = response.choices[0]
        assert calls_of(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
        assert (choice.message.content or "", choice.finish_reason) == ("", reason)
    _, prompt_ids, params = engine.requests[-1]
    assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith(PROMPT_REQUIRED + header)
    grammar = params.structured_output.grammar
    rest = engine.reply.removesuffix("<|call|>")
    assert _is_grammar_accept_string(grammar, rest)
    assert not _is_grammar_accept_string(grammar, rest.replace("city", "town"))  # held to the schema
    if tool_choice == "required":  # any of the tools, and only them
        assert _is_grammar_accept_string(grammar, "now <|constrain|>json<|message|>{}")
        assert not _is_grammar_accept_string(grammar, "get_time <|constrain|>json<|message|>{}")


def test_forced_call_through_responses(server):
    _, client, engine = server
    engine.reply = '{"city": "Rome"}<|call|>'
    r = client.responses.create(model="gpt-oss", input="X?", tools=[{**TOOLS[0]["function"], "type": "function"}],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in r.output] == ["function_call"]
    assert (r.output[0].name, json.loads(r.output[0].arguments)) == ("get_weather", {"city": "Rome"})
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert prompt.endswith(OPENING.format("get_weather"))


def test_a_forced_call_with_a_response_format_is_a_400(server):
    url, _, engine = server
    before = len(engine.requests)
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-oss", "messages": [{"role": "user", "content": "X?"}], "tools": TOOLS, "tool_choice": NAMED,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and "already constrains" in error["message"]
    assert len(engine.requests) == before  # refused before it reached the engine


def test_strict_functions_are_served_unconstrained(server):
    """No call grammar for harmony: strict functions (the default of /v1/responses) are parsed as usual."""
    url, _, engine = server
    engine.reply = CALL_PARIS
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": "gpt-oss", "messages": [{"role": "user", "content": "X?"}], "tools": strict})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_history_with_a_call_and_its_reply_renders(server):
    _, client, engine = server
    engine.reply = "<|channel|>final<|message|>Sunny in Paris.<|return|>"
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    choice = ask(client, messages=history, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Sunny in Paris.", "stop")
    prompt = engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            "<|start|>assistant") in prompt
