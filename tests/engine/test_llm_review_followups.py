"""Review follow-ups on the offline API: chat_template_kwargs that name chat()'s own template arguments yield to them
as in vLLM's LLM.chat (the conversation and the template are refused by name, not a bare TypeError), and
truncate_prompt_tokens is refused in the server's words by both (no "max_tokens None")."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from radiance import SamplingParams
from radiance.engine.request_checks import SamplingParamsError
from radiance.server.errors import OpenAIError
from radiance.server.serving_common import truncate_prompt

CONTEXT = 64
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
HI = [{"role": "user", "content": "Hi"}]
# every argument chat() hands the template, visible in the prompt
TEMPLATE = ("{{ messages[-1]['content'] }}{% if tools %} tools:{{ tools | length }}{% endif %}"
            "{% if add_generation_prompt %} go{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_text_llm):
    return tiny_text_llm(max_model_len=CONTEXT)


def prompt_of(llm, *args, **kwargs) -> str:
    return llm.get_tokenizer().decode(llm.chat(HI, GREEDY, *args, use_tqdm=False, **kwargs)[0].prompt_token_ids)


@pytest.mark.parametrize("key, value", [("add_generation_prompt", False), ("continue_final_message", True)])
def test_chat_s_own_flags_win_over_kwargs_of_their_names(llm, key, value):
    """As vLLM's LLM.chat merges its arguments over chat_template_kwargs; here they were passed twice:
    "apply_chat_template() got multiple values for keyword argument"."""
    assert prompt_of(llm, chat_template=TEMPLATE, chat_template_kwargs={key: value}) == \
        prompt_of(llm, chat_template=TEMPLATE)


@pytest.mark.parametrize("key, value", [("chat_template", "{{ messages[0]['content'] }}!"),
                                        ("tools", [{"type": "function"}] * 2)])
def test_tools_and_template_in_kwargs_count_where_chat_has_none(llm, key, value):
    base = {"chat_template": TEMPLATE} if key == "tools" else {}
    from_kwargs = prompt_of(llm, **base, chat_template_kwargs={key: value})
    assert from_kwargs == prompt_of(llm, **base, **{key: value})
    assert from_kwargs != prompt_of(llm, chat_template=TEMPLATE)
    own = {"chat_template": TEMPLATE, "tools": [{"type": "function"}]}
    assert prompt_of(llm, **own, chat_template_kwargs={key: value}) == prompt_of(llm, **own)  # chat()'s win


@pytest.mark.parametrize("key, says", [("messages", "pass the conversation as chat()'s messages"),
                                       ("template", "pass a template as chat()'s chat_template")])
def test_the_conversation_and_template_are_refused_by_name(llm, key, says):
    """render_chat's own arguments: "got multiple values for argument 'messages'", a bare TypeError."""
    with pytest.raises(ValueError, match="^" + re.escape(f"chat_template_kwargs may not set {key!r}: {says}")):
        llm.chat(HI, GREEDY, chat_template=TEMPLATE, chat_template_kwargs={key: []}, use_tqdm=False)


def test_template_as_another_keyword_is_refused_too(llm):
    with pytest.raises(ValueError, match="may not set 'template'"):  # other keywords reach the template as well
        llm.chat(HI, GREEDY, chat_template=TEMPLATE, use_tqdm=False, template="x")


@pytest.mark.parametrize("max_tokens, limit", [(None, f"max_model_len {CONTEXT} = {CONTEXT}"),
                                               (8, f"max_model_len {CONTEXT} - max_tokens 8 = {CONTEXT - 8}")])
def test_truncate_prompt_tokens_past_the_room_is_refused_as_the_server_refuses_it(llm, max_tokens, limit):
    """The offline API said "max_model_len 64 - max_tokens None = 64" in a copy of the server's check."""
    keep = CONTEXT + 436
    message = f"truncate_prompt_tokens {keep} is more than the prompt may have ({limit})"
    with pytest.raises(SamplingParamsError, match=f"^{re.escape(message)}$") as err:
        llm.generate([[5] * 10], SamplingParams(max_tokens=max_tokens, truncate_prompt_tokens=keep), use_tqdm=False)
    assert err.value.field == "truncate_prompt_tokens"
    # the server's check, unchanged: a 400 naming the field, in the same words
    req = SimpleNamespace(truncate_prompt_tokens=keep, output_limit=lambda: max_tokens)
    with pytest.raises(OpenAIError) as answer:
        truncate_prompt(SimpleNamespace(max_model_len=CONTEXT), [5] * 10, req)
    assert (answer.value.status, answer.value.param, answer.value.message) == (400, "truncate_prompt_tokens", message)


def test_truncation_still_keeps_the_last_tokens(llm):
    prompt = list(range(10, 40))
    out = llm.generate([prompt], SamplingParams(max_tokens=2, truncate_prompt_tokens=7), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-7:]
    out = llm.generate([[5] * (CONTEXT + 3)], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == CONTEXT - 2
