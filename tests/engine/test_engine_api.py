"""What a user of `LLM`, `LLMEngine` and `AsyncLLMEngine` meets at the edges: n, stop tokens and their text,
extreme sampling parameters, on the tiny models (CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine
from radiance.layers.sampler import LogitAdjustment, OutputCounts, SamplingRow, adjust_logits, sample

PROMPT = [5, 9, 9, 200, 17, 3, 41, 250, 7]


# ---------------------------------------------------------------- n


def test_the_async_engine_refuses_n_above_one(tiny_llm):
    """AsyncLLMEngine.generate took n=2 and streamed one completion; its outputs have room for one, and the
    server already sends n requests, so n > 1 is refused (one line, nothing queued)."""
    engine = AsyncLLMEngine(engine=tiny_llm(max_num_seqs=4).engine)

    async def run():
        async for _ in engine.generate("r", PROMPT, SamplingParams(n=2, max_tokens=3, seed=1)):
            pass

    with pytest.raises(ValueError, match="n is 2.*send n requests"):
        asyncio.run(run())
    assert not engine.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="n is 3"):
        engine.engine.add_request("s", PROMPT, SamplingParams(n=3))
    assert not engine.engine.has_unfinished_requests()


def test_llm_expands_n_into_distinct_reproducible_completions(tiny_llm):
    llm = tiny_llm(max_num_seqs=4)
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert first == again and len({tuple(c) for c in first}) == 3
    assert [c.index for c in llm.generate([PROMPT], params)[0].outputs] == [0, 1, 2]


# ---------------------------------------------------------------- stop tokens


def _greedy(llm, prompt, max_tokens, **options):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **options)
    return llm.generate([prompt], params)[0].outputs[0]


def _stream(engine, prompt, params) -> list:
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_stop_token_ends_token_ids_but_not_the_text(tiny_text_llm):
    """Stopping on a stop_token_ids token left that token's text at the end of the output; vLLM keeps the id
    in token_ids and leaves its text out, streamed or not."""
    llm = tiny_text_llm(max_num_seqs=4)
    prompt = llm.tokenizer("The lazy dog").input_ids
    ids = _greedy(llm, prompt, 8).token_ids
    # a token of the greedy path that shows up there first, after some text, and adds text of its own
    k = next(k for k in range(1, 8) if ids[k] not in ids[:k]
             and "" != _greedy(llm, prompt, k).text != _greedy(llm, prompt, k + 1).text)
    outs = _stream(llm.engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[ids[k]]))
    final = outs[-1]
    assert final.token_ids == ids[:k + 1] and final.finish_reason == "stop"
    assert final.text == _greedy(llm, prompt, k).text  # the text of the tokens before it
    assert all(final.text.startswith(o.text) for o in outs)  # no streamed text is taken back


def test_stop_strings_across_tokens_are_cut_before_or_after_as_asked(tiny_text_llm):
    """include_stop_str_in_output (vLLM's) keeps the stop string, or the stop token's text, that ended the
    output; without it the text ends before them. A stop string across two tokens stops at the second."""
    llm = tiny_text_llm(max_num_seqs=4)
    prompt = llm.tokenizer("The lazy dog").input_ids
    ids, texts = _greedy(llm, prompt, 8).token_ids, [_greedy(llm, prompt, k).text for k in range(1, 9)]
    # the last character of one token's text and the first of the next one's
    k = next(k for k in range(1, 8) if texts[k - 1] and texts[k].startswith(texts[k - 1])
             and len(texts[k]) > len(texts[k - 1]) and ids[k] not in ids[:k])
    stop = texts[k - 1][-1] + texts[k][len(texts[k - 1])]
    at = texts[-1].find(stop)
    assert at == len(texts[k - 1]) - 1  # the first place it shows up
    for include, text in ((False, texts[-1][:at]), (True, texts[-1][:at + 2])):
        outs = _stream(llm.engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                          stop=[stop], include_stop_str_in_output=include))
        assert outs[-1].text == text and outs[-1].finish_reason == "stop" and outs[-1].token_ids == ids[:k + 1]
        assert all(text.startswith(o.text) for o in outs)
        assert outs[-1].stop_reason == stop and all(o.stop_reason is None for o in outs[:-1])  # vLLM's field
    with_token = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[k]],
                                include_stop_str_in_output=True)
    by_token = llm.generate([prompt], with_token)[0].outputs[0]
    assert by_token.text == texts[k] and by_token.stop_reason == ids[k]
    assert _greedy(llm, prompt, 8).stop_reason is None  # ended by length


def test_the_eos_text_joins_the_text_only_with_include_stop_str_in_output(tiny_text_llm):
    """An EOS stop ends token_ids; as in vLLM its text is in text only with include_stop_str_in_output (and
    special tokens kept): skip_special_tokens=False alone no longer adds it (the server asks for both where
    its harmony parser reads gpt-oss's <|call|> / <|return|>)."""
    llm = tiny_text_llm(max_num_seqs=4)
    eos = llm.tokenizer.eos_token_id
    prompt = llm.tokenizer("The quick brown").input_ids
    for skip, include, text in ((False, False, ""), (False, True, "<eos>"), (True, False, ""), (True, True, "")):
        params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={eos: 100.0}, skip_special_tokens=skip,
                                include_stop_str_in_output=include)
        out = llm.generate([prompt], params)[0].outputs[0]
        assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == text


# ---------------------------------------------------------------- extreme sampling parameters


def _penalty_row(temperature: float, repetition: float, seen: list[int], vocab: int) -> SamplingRow:
    counts = OutputCounts(vocab, torch.device("cpu"), seen)
    return SamplingRow(temperature, adjust=LogitAdjustment((), repetition, 0.0, 0.0, counts))


@pytest.mark.parametrize("repetition", [1e-308, 1e-40, 1e-30, 1e30, 1e300, 1e308])
def test_extreme_repetition_penalties_keep_the_logits_finite(repetition):
    """repetition_penalty 1e-308 is 0 in float32: seen logits / 0 went to inf and the sampled row to NaN (token
    0, a token the penalty had nothing to do with); 1e308 is inf, and a seen logit of 0 times inf NaN."""
    torch.manual_seed(0)
    vocab, seen = 40, [3, 7, 11, 20]
    logits = torch.randn(1, vocab) * 3
    logits[0, seen] = torch.tensor([2.0, 1.0, 0.0, -1.5])
    adjusted = adjust_logits(logits, [_penalty_row(1.0, repetition, seen, vocab)])
    assert torch.isfinite(adjusted).all()
    rows = [_penalty_row(t, repetition, seen, vocab) for t in (0.0, 0.7, 1.0)] * 20
    picked = sample(logits.repeat(len(rows), 1), rows).token_ids
    if repetition < 1:  # the seen positive logits dwarf all others
        assert set(picked) <= {3, 7}
    else:  # the seen ones shrink toward 0 or far below: never the NaN's pick
        assert 11 not in picked[:1] and 20 not in picked


def test_a_temperature_past_float32_samples_uniformly_among_allowed_tokens():
    """temperature 1e308 is inf in float32: the logits / inf were 0 but a masked (-inf) logit / inf NaN, and
    the NaN row's argmax picked a masked token."""
    logits = torch.randn(1, 16)
    logits[0, :8] = float("-inf")  # what a structured output's mask leaves
    picked = sample(logits.repeat(800, 1), [SamplingRow(1e308)] * 800).token_ids
    counts = torch.bincount(torch.tensor(picked), minlength=16)
    assert counts[:8].sum() == 0 and counts[8:].min() > 50  # allowed tokens only, about evenly


@pytest.mark.parametrize("row", [SamplingRow(1.0, top_p=1e-300), SamplingRow(1.0, min_p=1.0),
                                 SamplingRow(1.0, min_p=1e-300, top_k=1), SamplingRow(1e-4, top_p=1e-300)])
def test_tightest_filters_leave_the_best_token(row):
    logits = torch.randn(8, 50)
    assert sample(logits, [row] * 8).token_ids == logits.argmax(-1).tolist()


def test_extreme_parameters_through_the_engine(tiny_llm):
    """The parameters at their limits run through LLM.generate and give tokens of the vocabulary."""
    llm = tiny_llm(max_num_seqs=8)
    vocab = llm.engine.model.config.vocab_size
    params = [SamplingParams(max_tokens=4, seed=1, ignore_eos=True, **extreme) for extreme in (
        dict(repetition_penalty=1e-308), dict(repetition_penalty=1e308), dict(temperature=2.0),  # vLLM's most
        dict(frequency_penalty=2.0, presence_penalty=-2.0), dict(top_p=1e-300, min_p=1.0))]
    outs = llm.generate([PROMPT] * len(params), params)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 4 and all(0 <= t < vocab for t in ids)
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert outs[-1].outputs[0].token_ids == greedy.outputs[0].token_ids  # the tightest filters leave the best token


def test_stop_strings_without_a_tokenizer_are_refused(tiny_llm):
    """A model without a tokenizer has no text to match: its stop strings were accepted and never stopped it."""
    llm = tiny_llm(max_num_seqs=4)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, stop=["x"]))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4, stop=[]))[0].outputs[0].finish_reason is not None


def test_prompt_token_ids_must_be_integers(tiny_llm):
    """A float id passed the vocabulary range check and was served as some token (2.5 as 2)."""
    engine = tiny_llm(max_num_seqs=4).engine
    for bad in ([1, 2.5, 3], [True, 4]):
        with pytest.raises(ValueError, match="prompt_token_ids must be integer token ids"):
            engine.add_request("r", bad, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
