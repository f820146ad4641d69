"""The text of the EOS token that ends an output: as in vLLM, its id ends token_ids but its text joins text only
with include_stop_str_in_output, streamed or not, whatever skip_special_tokens says. The server's harmony requests
(gpt-oss, whose <|call|> / <|return|> are EOS tokens its parser reads) read a stop without it as one with it
(tests/server/test_harmony_without_eos_text.py). Tiny models, CPU."""

from __future__ import annotations

import asyncio

import pytest

from radiance import SamplingParams
from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.engine.async_engine import AsyncLLMEngine
from radiance.server.protocol import ChatCompletionRequest
from radiance.server.serving_common import sampling_params


@pytest.fixture(scope="module")
def llm(tiny_text_llm):
    return tiny_text_llm(max_num_seqs=4)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer("The quick brown").input_ids


def _eos_after_two(llm, **options) -> SamplingParams:
    """Two tokens of text (EOS banned by min_tokens), then EOS (its logit pushed to the top)."""
    eos = llm.tokenizer.eos_token_id
    return SamplingParams(max_tokens=6, min_tokens=2, temperature=0.0, logit_bias={eos: 100.0}, **options)


def _steps(engine, prompt, params) -> list:
    engine.add_request("eos", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def two_tokens(llm, prompt):
    """The text of the two tokens before the EOS."""
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                logit_bias={llm.tokenizer.eos_token_id: -100.0}))[0].outputs[0]
    assert out.text and "<eos>" not in out.text
    return out.text


@pytest.mark.parametrize("include", [False, True])
def test_kept_special_tokens_show_the_eos_text_only_with_include_stop_str(llm, prompt, two_tokens, include):
    outs = _steps(llm.engine, prompt, _eos_after_two(llm, skip_special_tokens=False,
                                                     include_stop_str_in_output=include))
    final = outs[-1]
    assert final.token_ids[-1] == llm.tokenizer.eos_token_id and len(final.token_ids) == 3
    assert final.finish_reason == "stop"
    assert final.text == two_tokens + ("<eos>" if include else "")
    assert all(final.text.startswith(o.text) for o in outs)  # no streamed text is taken back
    assert all("<eos>" not in o.text for o in outs[:-1])


def test_the_async_engine_streams_no_eos_text(llm, prompt, two_tokens):
    """What the server streams: each output's text grows, and none has the EOS text."""
    engine = AsyncLLMEngine(engine=llm.engine)

    async def run():
        try:
            return [o async for o in engine.generate("a", prompt, _eos_after_two(llm, skip_special_tokens=False))]
        finally:
            await engine.shutdown()

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].token_ids[-1] == llm.tokenizer.eos_token_id
    assert [o.text for o in outs if o.text][-1] == two_tokens
    assert all("<eos>" not in o.text for o in outs)


def test_an_eos_that_ends_nothing_keeps_its_text(llm, prompt):
    """With ignore_eos an EOS is just a token: kept special tokens show it (vLLM's stop_terminated is false)."""
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={eos: 100.0},
                            skip_special_tokens=False)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == [eos, eos] and out.finish_reason == "length" and out.text == "<eos><eos>"


def _chat(llm, **fields) -> ChatCompletionRequest:
    eos = llm.tokenizer.eos_token_id
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0, min_tokens=2,
                                 logit_bias={str(eos): 100.0}, **fields)


def test_kept_special_tokens_still_hide_the_eos_text(llm, prompt, two_tokens):
    """serving_chat keeps special tokens for the harmony parser (keep_special_tokens), not the EOS text: a
    client's stop strings stay out of the text as they should."""
    params = sampling_params(_chat(llm), 6, 0, None, SamplingDefaults(), keep_special_tokens=True)
    assert params.include_stop_str_in_output is False and params.skip_special_tokens is False
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids[-1] == llm.tokenizer.eos_token_id
    assert out.text == two_tokens


def test_a_request_keeps_its_own_include_stop_str(llm):
    """Outside harmony, the client's include_stop_str_in_output and skip_special_tokens go through as sent."""
    params = sampling_params(_chat(llm, include_stop_str_in_output=True, skip_special_tokens=False), 6, 0, None,
                             SamplingDefaults())
    assert params.include_stop_str_in_output is True and params.skip_special_tokens is False
    assert sampling_params(_chat(llm), 6, 0, None, SamplingDefaults()).include_stop_str_in_output is False
