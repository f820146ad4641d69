"""SamplingParams.min_tokens (vLLM's): EOS and the stop_token_ids are banned until the output has that many
tokens, and a stop string counts only where it ends after them."""

from __future__ import annotations

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.detokenizer import IncrementalDetokenizer
from radiance.engine.sampling_params import SamplingParamsError
from radiance.layers.sampler import LogitAdjustment, SamplingRow, adjust_logits, sample
from tests.engine.conftest import tiny_byte_bpe_tokenizer

PROMPTS = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100)), [200, 201]]


@pytest.mark.parametrize("bad, message", [
    (dict(min_tokens=-1), "min_tokens must be non-negative, got -1"),
    (dict(min_tokens=1.5), "min_tokens must be an integer, got 1.5"),
    (dict(min_tokens=None), "min_tokens must be an integer, got None"),
    (dict(min_tokens=True), "min_tokens must be an integer, got True"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens must be at most max_tokens, got min_tokens 17 > max_tokens 16"),
])
def test_sampling_params_check_min_tokens(bad, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**bad)
    SamplingParams(min_tokens=16, max_tokens=16)
    SamplingParams(min_tokens=5000, max_tokens=None)


def test_a_ban_is_minus_infinity_whatever_the_bias_and_penalties():
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0], [1.0, 5.0, 2.0, 0.0]])
    banned = LogitAdjustment(bias=((1, 100.0),), frequency=0.5, banned=(1, 3))
    out = adjust_logits(logits, [SamplingRow(0.0, adjust=banned), SamplingRow(0.0)])
    assert out[0].tolist() == [1.0, float("-inf"), 2.0, float("-inf")] and torch.equal(out[1], logits[1])
    hot = SamplingRow(50.0, adjust=LogitAdjustment(banned=(1,)), generator=torch.Generator().manual_seed(0))
    assert all(t != 1 for t in sample(logits[:1].repeat(20, 1), [hot] * 20).token_ids)  # sampled rows too


def test_a_structured_output_that_allows_only_banned_tokens_ends_as_its_grammar_says():
    """Its constraint complete, a structured output allows only EOS: with EOS banned too every logit was -inf,
    and the choice token 0, which the constraint then refused (its text joined the output)."""
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0]] * 3)
    only_2 = torch.tensor([1 << 2], dtype=torch.int32)  # xgrammar's words: bit t allows token t
    both = torch.tensor([(1 << 2) | (1 << 3)], dtype=torch.int32)
    rows = [SamplingRow(0.0, adjust=LogitAdjustment(allowed=only_2, banned=(2,))),
            SamplingRow(0.0, adjust=LogitAdjustment(allowed=both, banned=(2,))),  # something else left: banned
            SamplingRow(0.0, adjust=LogitAdjustment(banned=(1,), bias=((3, 10.0),)))]
    out = adjust_logits(logits, rows)
    assert out[0].tolist() == [float("-inf"), float("-inf"), 2.0, float("-inf")]
    assert out[1].tolist() == [float("-inf"), float("-inf"), float("-inf"), 0.0]
    assert out[2].tolist() == [1.0, float("-inf"), 2.0, 10.0]
    assert sample(logits, rows).token_ids == [2, 3, 3]


def _generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("options", [dict(), dict(overlap_decode=True), dict(max_num_batched_tokens=16)],
                         ids=["plain", "overlap", "chunked"])
def test_eos_forced_early_waits_for_the_minimum(tiny_llm, options):
    llm = tiny_llm(max_num_seqs=4, **options)
    eos = min(llm.engine.eos_token_ids)
    forced = dict(max_tokens=30, temperature=0.0, logit_bias={eos: 100.0})
    early = _generate(llm, PROMPTS, SamplingParams(**forced))
    assert all(o.token_ids == [eos] and o.finish_reason == "stop" for o in early)  # not vacuous
    assert all(o.stop_reason is None for o in early)  # vLLM's stop_reason: None for EOS
    # each request its own minimum (0: no ban), in one batch
    params = [SamplingParams(**forced, min_tokens=m) for m in (9, 0, 4)]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    for p, o in zip(params, outs):
        assert len(o.token_ids) == p.min_tokens + 1 and o.token_ids[-1] == eos and o.finish_reason == "stop"
        assert eos not in o.token_ids[:-1]
    if options.get("overlap_decode"):
        assert llm.engine.overlapped_steps > 0
    # at temperature 1 too (the sampled path), and min_tokens == max_tokens ends by length
    hot = _generate(llm, PROMPTS, SamplingParams(max_tokens=30, temperature=1.0, seed=3, logit_bias={eos: 100.0},
                                                 min_tokens=6))
    assert all(len(o.token_ids) == 7 and o.token_ids[-1] == eos for o in hot)
    full = _generate(llm, PROMPTS[:1], SamplingParams(**dict(forced, max_tokens=5), min_tokens=5))[0]
    assert len(full.token_ids) == 5 and eos not in full.token_ids and full.finish_reason == "length"


@pytest.mark.gpu
def test_gpu_graph_decode_and_overlap_keep_the_minimum(tiny_llm):
    """The decode steps replay CUDA graphs and are queued ahead of the host: the ban rides the eager sampler
    after the graph, counting the token still on the device."""
    llm = tiny_llm(device="cuda", dtype="bfloat16", num_gpu_blocks_override=128, max_num_seqs=4,
                   cuda_graph_max_batch=4, overlap_decode=True)
    assert llm.engine.runner.decode_graphs is not None
    eos = min(llm.engine.eos_token_ids)
    params = [SamplingParams(max_tokens=30, temperature=t, logit_bias={eos: 100.0}, min_tokens=m)
              for t, m in ((0.0, 9), (0.0, 0), (1.0, 12))]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [len(o.token_ids) for o in outs] == [10, 1, 13] and all(o.token_ids[-1] == eos for o in outs)
    assert llm.engine.overlapped_steps > 0


def test_stop_token_ids_are_banned_until_the_minimum_and_eos_stays_ignored(tiny_llm):
    llm = tiny_llm()
    eos = min(llm.engine.eos_token_ids)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[7],
                            logit_bias={7: 100.0, eos: 50.0}, min_tokens=3)
    out = _generate(llm, PROMPTS[:1], params)[0]
    assert out.token_ids == [eos, eos, eos, 7] and out.finish_reason == "stop"  # EOS ignored: neither banned nor a stop
    assert out.stop_reason == 7
    # EOS listed in stop_token_ids too: EOS is looked at first, as in vLLM
    both = _generate(llm, PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[eos],
                                                      logit_bias={eos: 100.0}))[0]
    assert both.token_ids == [eos] and both.stop_reason is None


def test_speculative_rows_count_the_drafts_before_them(tiny_llm):
    """A draft row's ban depends on its own position: the same tokens as without speculation."""
    from tests.engine.test_speculative import LOOPY

    plain, spec = tiny_llm(), tiny_llm(ngram_draft_tokens=8)
    prompt = LOOPY[1]
    full = _generate(plain, [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    stop_at = full[20]  # recurs as the output loops, and a step's drafts span the 30th token
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_at], min_tokens=30)
    want = _generate(plain, [prompt], params)[0]
    got = _generate(spec, [prompt], params)[0]
    assert got.token_ids == want.token_ids and stop_at not in want.token_ids[:30] and want.finish_reason == "stop"
    assert spec.engine.accepted_draft_tokens > 0


TEXT = "Paris is the capital of France, and Rome is the capital of Italy."


def _detokenize(min_tokens: int, stop: tuple[str, ...], include_stop: bool = False) -> tuple[str, int]:
    """The text the engine's rule keeps, and how many tokens went in before a stop string ended it."""
    tokenizer = tiny_byte_bpe_tokenizer()
    ids = tokenizer.encode(TEXT)
    d = IncrementalDetokenizer(tokenizer, [tokenizer.eos_token_id], stop=stop, include_stop=include_stop)
    for n, token in enumerate(ids, 1):
        if d.add_token(token, check_stop=n > min_tokens):
            return d.text, n
    return d.text, len(ids)


def test_stop_strings_count_only_where_they_end_after_the_minimum():
    tokenizer = tiny_byte_bpe_tokenizer()
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(TEXT)]
    assert pieces[:3] == ["Paris", " is", " the"]  # the cases below rely on this split
    assert _detokenize(0, ("is",)) == ("Par", 1)
    # vLLM's rule: the first min_tokens tokens' text is not searched ("is" in "Paris"), later text is
    assert _detokenize(1, ("is",)) == ("Paris ", 2)
    # a stop string that starts in the minimum and ends after it counts ("s i" ends in " is")
    assert _detokenize(1, ("s i",)) == ("Pari", 2)
    assert _detokenize(1, ("s i",), include_stop=True) == ("Paris i", 2)
    assert _detokenize(2, ("s i",)) == (TEXT, len(pieces))  # wholly inside the minimum: never
    assert _detokenize(3, ("the",)) == ("Paris is the capital of France, and Rome is ", 18)  # the next one


def test_engine_stop_strings_wait_for_the_minimum(tiny_text_llm):
    llm = tiny_text_llm()
    free = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = _generate(llm, ["Paris is"], SamplingParams(**free))[0]
    again = full.token_ids.index(full.token_ids[0], 1)  # this random model says "An" first, and again later
    assert llm.tokenizer.decode(full.token_ids[:1]) == "An" and again == 15
    first = _generate(llm, ["Paris is"], SamplingParams(**free, stop="An"))[0]
    assert first.token_ids == full.token_ids[:1] and first.text == "" and first.finish_reason == "stop"
    later = _generate(llm, ["Paris is"], SamplingParams(**free, stop="An", min_tokens=3))[0]
    assert later.token_ids == full.token_ids[:again + 1] and later.finish_reason == "stop"
    assert later.text == full.text[:full.text.index("An", 1)]
