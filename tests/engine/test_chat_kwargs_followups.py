"""The second review of this session's chat_template_kwargs changes: LLM.chat picks the tool_use template for
tools=[] as transformers and the server do, and a null kwarg is unset in LLM.chat as on the server (where it also
leaves reasoning_effort "none" to turn thinking off)."""

from __future__ import annotations

import httpx
import pytest

from radiance import SamplingParams
from tests.server.fake_engine import FakeEngine, serve_engine

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
HI = [{"role": "user", "content": "hi"}]
PROBE = "{% for m in messages %}{{ m.content }}{% endfor %}[x={{ x if x is defined else 'unset' }}]"


@pytest.fixture(scope="module")
def llm(tiny_text_llm):
    llm = tiny_text_llm(max_num_seqs=2)
    llm.engine.chat_template = "default:" + PROBE
    llm.engine.chat_templates = {"default": llm.engine.chat_template, "tool_use": "tool_use:" + PROBE}
    return llm


def prompt_of(llm, **kwargs) -> str:
    return llm.get_tokenizer().decode(llm.chat(HI, GREEDY, use_tqdm=False, **kwargs)[0].prompt_token_ids)


@pytest.mark.parametrize("given", [{"tools": []}, {"chat_template_kwargs": {"tools": []}},
                                   {"tools": [{"type": "function", "function": {"name": "f"}}]}])
def test_tools_given_even_empty_pick_the_tool_use_template(llm, given):
    """transformers picks tool_use when tools is not None (the server's kwargs path too); LLM.chat needed a
    non-empty list."""
    assert prompt_of(llm, **given).startswith("tool_use:")
    assert prompt_of(llm).startswith("default:")


def test_a_null_kwarg_is_unset_in_llm_chat_as_on_the_server(llm):
    assert prompt_of(llm, chat_template_kwargs={"x": None}).endswith("[x=unset]")
    assert prompt_of(llm, x=None).endswith("[x=unset]")
    assert prompt_of(llm, chat_template_kwargs={"x": 3}).endswith("[x=3]")


@pytest.mark.parametrize("kwargs, thinking", [(None, "False"), ({"enable_thinking": None}, "False"),
                                              ({"enable_thinking": True}, "True")])
def test_a_null_enable_thinking_leaves_reasoning_effort_none_its_say(kwargs, thinking):
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "[thinking={{ enable_thinking if enable_thinking is defined else 'unset' }}]")
    engine = FakeEngine(chat_template=template)
    body = {"model": "fake", "messages": [{"role": "user", "content": "SAY:x"}], "reasoning_effort": "none"}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    with serve_engine(engine) as url:
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    prompt = engine.tokenizer.decode(engine.requests[-1][1])
    assert f"[thinking={thinking}]" in prompt
