"""Whether the model starts inside a `<think>` block is read from the template's text after the last message:
a user who writes `<think>` in a question opens nothing (the whole answer came back as reasoning before)."""

import openai
import pytest

from radiance.server.chat_template import prompt_opens_thinking
from tests.server.fake_engine import FakeEngine, serve_engine


@pytest.mark.parametrize("prompt, last, continuing, opens", [
    ("<|im_start|>assistant\n<think>\n", "", False, True),  # no message to place: any open block counts
    ("U: hi<A><think>\n", "hi", False, True),  # the template opened it
    ("U: k<A><think>\n", "k", False, True),  # a short message also found inside the opening's text
    ("U: what is <think>?<|end|><A>", "what is <think>?", False, False),  # the user's text
    ("U: what is <think>?<|end|>A: a tag<|end|>U: thanks<A>", "thanks", False, False),  # an earlier user turn
    ("U: x<A><think>\nhmm", "<think>\nhmm", True, True),  # the continued answer opened it
    ("U: x<A><think>\nhmm</think>ok", "<think>\nhmm</think>ok", True, False),  # and closed it
    ("U: <b>hi</b><A><think>", "hi", False, True),  # the message not rendered verbatim: the old rule
])
def test_prompt_opens_thinking_only_after_the_last_message(prompt, last, continuing, opens):
    assert prompt_opens_thinking(prompt, last, continuing) is opens


@pytest.fixture(scope="module")
def client():
    with serve_engine(FakeEngine(max_model_len=2048), reasoning_parser="think") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, text, **kw):
    return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": text}], **kw)


def test_a_think_tag_in_the_question_leaves_the_answer_as_content(client):
    message = ask(client, "What does <think> do? SAY:It marks reasoning.").choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None)) == ("It marks reasoning.", None)
    streamed = list(ask(client, "What does <think> do? SAY:It marks reasoning.", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "It marks reasoning."


def test_a_template_opened_block_is_still_reasoning(client):
    message = ask(client, "SAY:plan</think>Answer", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = message.choices[0].message
    assert (message.content, message.reasoning_content) == ("Answer", "plan")


def test_the_fake_engine_streams_split_characters_whole(client):
    """A character of several bytes (one token each here) comes out once all its bytes are generated, as the
    real detokenizer holds it back; the fake sent U+FFFD and the server then lost the character."""
    streamed = list(ask(client, "SAY:Köln 😀", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Köln 😀"
