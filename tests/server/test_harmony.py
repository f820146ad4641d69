"""gpt-oss's harmony format: the reasoning parser on fixed strings (whole, char by char, split anywhere),
its pick from the chat template, and chat / Responses requests through the scripted engine, whose
tokenizer drops the markers (special tokens) unless the request keeps them."""

import asyncio

import openai
import pytest

from radiance.config import ServerConfig
from radiance.server.api import build_app
from radiance.server.chat_template import template_features
from radiance.server.protocol import ChatCompletionRequest
from radiance.server.reasoning_parser import HARMONY_MARKERS, HarmonyReasoningParser, split_reasoning
from radiance.server.serving_chat import prepare_chat
from radiance.server.state import ServerState
from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_in_thread

# gpt-oss's template, cut down: what matters is <|channel|> in it and the prompt ending `<|start|>assistant`
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

THOUGHT_THEN_ANSWER = ("<|channel|>analysis<|message|>The user asks for X. Let me think...<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>The answer is 42.<|return|>")

CASES = [  # output text, reasoning, content
    pytest.param(THOUGHT_THEN_ANSWER, "The user asks for X. Let me think...", "The answer is 42.", id="analysis-final"),
    pytest.param("<|channel|>final<|message|>Just the answer.<|return|>", "", "Just the answer.", id="final-only"),
    pytest.param("<|channel|>analysis<|message|>Check the weather first.<|end|>"
                 "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
                 "Check the weather first.", "Let me look that up.\n\nSunny.", id="commentary-preamble"),
    pytest.param("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "One.\n\nTwo.", "Done.",
                 id="two-analysis-messages"),
    # a message to a function is neither reasoning nor content: it is handed on whole (test_harmony_tools)
    pytest.param("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
                 "Need the weather.", "", id="tool-call-recipient-after-channel"),
    pytest.param(' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>',
                 "", "", id="tool-call-recipient-before-channel"),
    pytest.param("A model that ignores the format.", "", "A model that ignores the format.", id="no-markup"),
    pytest.param("to be, or not to be", "", "to be, or not to be", id="no-markup-like-a-recipient"),
    pytest.param("Stray text first.<|channel|>final<|message|>Then the answer.<|return|>", "",
                 "Stray text first.\n\nThen the answer.", id="text-before-any-header"),
    pytest.param("<|channel|>analysis<|message|>Cut off while thin", "Cut off while thin", "", id="cut-mid-analysis"),
    pytest.param("<|channel|>analysis<|message|>Done thinking.<|end|><|start|>assistant<|channel|>fin",
                 "Done thinking.", "", id="cut-mid-header"),
    pytest.param("<|channel|>final<|message|>a <| b ends in <|", "", "a <| b ends in <|", id="marker-like-text"),
    # text outside messages (harmony has none: only <|start|> may follow a message's end) is content set apart
    # like a message of its own, the whitespace around it dropped (was glued on: "Hito")
    pytest.param("<|channel|>final<|message|>Hi<|end|>to", "", "Hi\n\nto", id="text-after-a-message"),
    pytest.param("<|channel|>final<|message|>A<|end|> stray \n<|start|>assistant<|channel|>final<|message|>B<|return|>",
                 "", "A\n\nstray\n\nB", id="text-between-messages"),
    pytest.param("<|channel|>analysis<|message|>x<|end|>\n to go", "x", "to go", id="text-after-reasoning"),
    # whitespace outside messages is no text (was content " ")
    pytest.param("<|channel|>final<|message|>A<|end|> \n <|start|>assistant<|channel|>final<|message|>B<|return|>",
                 "", "A\n\nB", id="blank-between-messages"),
    pytest.param("<|channel|>analysis<|message|>x<|end|> ", "x", "", id="blank-after-a-message"),
    pytest.param("Stray text first. <|channel|>final<|message|>Answer.<|return|>", "",
                 "Stray text first.\n\nAnswer.", id="text-before-a-header-loses-its-trailing-space"),
    pytest.param("  A model that ignores the format.\n", "", "  A model that ignores the format.\n",
                 id="no-markup-keeps-its-spacing"),
]


def parse_in_chunks(chunks):
    parser = HarmonyReasoningParser()
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return deltas, ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_harmony_whole_and_any_chunking_agree(text, reasoning, content):
    whole = split_reasoning(HarmonyReasoningParser(), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    deltas, got = parse_in_chunks(list(text))
    assert got == (reasoning, content)
    if content.count("<|") == 0:  # no delta ever shows a piece of a marker
        assert not any("<|" in d.reasoning + d.content or "|>" in d.reasoning + d.content for d in deltas)
    for cut in range(len(text) + 1):
        assert parse_in_chunks([text[:cut], text[cut:]])[1] == (reasoning, content), cut


def test_harmony_holds_back_a_marker_split_across_chunks():
    parser = HarmonyReasoningParser()
    header = parser.feed("<|channel|>analysis<|mess")
    assert (header.reasoning, header.content) == ("", "")
    first = parser.feed("age|>Let me see<|e")
    assert (first.reasoning, first.content) == ("Let me see", "")
    second = parser.feed("nd|><|start|>assistant<|channel|>final<|message|>42<")
    assert (second.reasoning, second.content) == ("", "42")
    last = parser.feed("|return|>")
    assert (last.reasoning, last.content) == ("", "")
    tail = parser.finish()
    assert (tail.reasoning, tail.content) == ("", "")


@pytest.mark.parametrize("flag,template,want", [
    ("auto", HARMONY_TEMPLATE, "harmony"), ("auto", HARMONY_TEMPLATE + "<think>", "harmony"),
    ("auto", TEMPLATE, "think"), ("think", HARMONY_TEMPLATE, "think"), ("harmony", TEMPLATE, "harmony"),
    ("none", HARMONY_TEMPLATE, None),
])
def test_harmony_picked_for_a_template_with_channels(flag, template, want):
    assert template_features(template)["harmony"] == ("<|channel|>" in template)
    state = ServerState(ServerConfig(reasoning_parser=flag), lambda: None)
    state.attach(FakeEngine(chat_template=template))
    assert state.reasoning_parser_name == want


def engine_skips_special_tokens(reasoning_parser, template, **request):
    """skip_special_tokens in the engine parameters that a chat request gets."""
    engine = FakeEngine(chat_template=template, special_tokens=HARMONY_MARKERS)
    state = ServerState(ServerConfig(reasoning_parser=reasoning_parser), lambda: engine)
    state.attach(engine)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **request)
    prepared = asyncio.run(prepare_chat(state, req, "chatcmpl-test"))
    return [job.params.skip_special_tokens for job in prepared.jobs]


def test_special_tokens_kept_only_for_the_harmony_parser():
    assert engine_skips_special_tokens("auto", HARMONY_TEMPLATE, n=2) == [False, False]
    assert engine_skips_special_tokens("none", HARMONY_TEMPLATE) == [True]
    assert engine_skips_special_tokens("auto", TEMPLATE) == [True]
    assert engine_skips_special_tokens("auto", TEMPLATE, skip_special_tokens=False) == [False]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(chat_template=HARMONY_TEMPLATE, special_tokens=HARMONY_MARKERS)
    state = ServerState(ServerConfig(served_model_name=("gpt-oss",)), engine_factory=lambda: engine)
    state.attach(engine)
    with serve_in_thread(build_app(state)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine


def ask(client, **kw):
    return client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "X?"}], **kw)


def test_chat_splits_reasoning_from_content(server):
    client, engine = server
    engine.reply = THOUGHT_THEN_ANSWER
    message = ask(client).choices[0].message
    assert message.content == "The answer is 42."
    assert message.model_extra["reasoning_content"] == "The user asks for X. Let me think..."
    assert engine.requests[-1][2].skip_special_tokens is False
    assert engine.tokenizer.decode(engine.requests[-1][1], skip_special_tokens=False).endswith("<|start|>assistant")


def test_chat_stream_splits_reasoning_from_content(server):
    client, engine = server
    engine.reply = THOUGHT_THEN_ANSWER
    deltas = [c.choices[0].delta for c in ask(client, stream=True) if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("The user asks for X. Let me think...", "The answer is 42.")
    assert engine.requests[-1][2].skip_special_tokens is False


def test_responses_give_a_reasoning_item_then_the_message(server):
    client, engine = server
    engine.reply = THOUGHT_THEN_ANSWER
    r = client.responses.create(model="gpt-oss", input="X?")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user asks for X. Let me think..."
    assert r.output_text == "The answer is 42."
    assert engine.requests[-1][2].skip_special_tokens is False
