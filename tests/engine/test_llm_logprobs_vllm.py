"""LLM.generate's logprobs in vLLM's shape: per output token {token id: Logprob(logprob, rank, decoded_token)} for
the sampled token and its top alternatives, prompt_logprobs [None, {...}, ...], and -1 for the whole vocabulary.
The numbers are checked against a no-cache forward of the model and against what the server writes for the same
engine output (its prompt_logprobs JSON), so the two APIs agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import radiance
from radiance import SamplingParams
from radiance.engine.outputs import Logprob
from radiance.engine.request_checks import SamplingParamsError
from radiance.server.logprobs_json import prompt_logprobs_json

TOL = 1e-4


@pytest.fixture(scope="module")
def text_llm(tiny_text_llm):
    """A tiny model with a tokenizer (decoded tokens), any number of logprobs."""
    return tiny_text_llm(max_num_seqs=4, max_logprobs=-1)


def _reference(llm, ids: list[int]) -> torch.Tensor:
    """The model's log-probabilities after each position of `ids` ([len(ids), V]), from a no-cache forward."""
    return llm.engine.runner.model.forward_logits(torch.tensor([ids]))[0].float().log_softmax(-1)


def _rank_bounds(row: torch.Tensor, token: int) -> tuple[int, int]:
    """vLLM's rank of `token` in `row` (1 + the tokens more likely), as bounds: a token within the tolerance of
    it may go either way."""
    target = row[token]
    return 1 + int((row > target + TOL).sum()), 1 + int((row > target - TOL).sum())


def _check_step(step: dict, token: int, row: torch.Tensor, k: int, tokenizer) -> None:
    """One output token's dict against the reference row: the token first, then the top k most likely first,
    ranked 1..k; every entry a Logprob naming its token's own text."""
    assert all(isinstance(v, Logprob) for v in step.values())
    ids = list(step)
    assert ids[0] == token
    top = row.topk(k).indices.tolist()
    assert set(ids) == {token, *top} and len(ids) == len({token, *top})
    for tid, entry in step.items():
        assert entry.logprob == pytest.approx(row[tid].item(), abs=TOL)
        assert entry.decoded_token == tokenizer.decode([tid])
    for rank, tid in enumerate(top, 1):
        if tid != token:
            assert step[tid].rank == rank


def test_output_logprobs_are_vllm_dicts_of_the_token_and_its_alternatives(text_llm):
    prompt = text_llm.tokenizer("The quick brown fox").input_ids
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    out = text_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    ref = _reference(text_llm, prompt + out.token_ids)
    assert isinstance(out.logprobs, list) and len(out.logprobs) == len(out.token_ids) == 6
    for pos, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + pos]
        _check_step(step, token, row, 3, text_llm.tokenizer)
        assert len(step) == 3 and step[token].rank == 1  # greedy: the most likely, among its alternatives
    # the idiom the shape is for
    assert [max(s.values(), key=lambda lp: lp.logprob).decoded_token for s in out.logprobs] == \
        [text_llm.tokenizer.decode([t]) for t in out.token_ids]
    assert out.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-5)


def test_a_sampled_token_ranks_among_its_alternatives_or_is_added_beside_them(text_llm):
    """vLLM always returns the sampled token, the (k + 1)-th entry when it is not among the top k, with its rank
    (the engine ranks it from the same logits: below the alternatives the rank was None)."""
    prompt = text_llm.tokenizer("Paris is").input_ids
    params = SamplingParams(n=4, max_tokens=12, temperature=2.0, seed=11, ignore_eos=True, logprobs=2)
    outs = text_llm.generate(prompt, params, use_tqdm=False)[0].outputs
    inside = outside = 0
    for out in outs:
        ref = _reference(text_llm, prompt + out.token_ids)
        for pos, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + pos]
            _check_step(step, token, row, 2, text_llm.tokenizer)
            lo, hi = _rank_bounds(row, token)
            if hi <= 2:  # among the top 2
                inside += 1
                assert len(step) == 2 and lo <= step[token].rank <= hi
            elif lo > 2:
                outside += 1
                assert len(step) == 3 and lo <= step[token].rank <= hi
    assert inside and outside  # both cases met at temperature 2


def test_whole_vocabulary_logprobs_rank_every_token(text_llm):
    """logprobs=-1 / prompt_logprobs=-1 (vLLM's): every token of the vocabulary at each position, so a sampled
    token's rank is always known."""
    vocab = text_llm.engine.vocab_size
    prompt = text_llm.tokenizer("Rome is the capital").input_ids
    params = SamplingParams(max_tokens=4, temperature=1.5, seed=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    result = text_llm.generate(prompt, params, use_tqdm=False)[0]
    out = result.outputs[0]
    ref = _reference(text_llm, prompt + out.token_ids)
    for pos, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + pos]
        assert len(step) == vocab
        lo, hi = _rank_bounds(row, token)
        assert lo <= step[token].rank <= hi
        # the others after it, most likely first, ranked by their place among all (the token's own place skipped)
        others = [(e.rank, e.logprob) for t, e in step.items() if t != token]
        ranks = [r for r, _ in others]
        assert ranks == sorted(set(ranks)) and 1 <= ranks[0] and ranks[-1] <= vocab
        assert [lp for _, lp in others] == sorted((lp for _, lp in others), reverse=True)
        assert step[token].logprob == pytest.approx(row[token].item(), abs=TOL)
    assert result.prompt_logprobs[0] is None
    assert [len(d) for d in result.prompt_logprobs[1:]] == [vocab] * (len(prompt) - 1)


def test_prompt_logprobs_agree_with_what_the_server_writes(text_llm):
    """prompt_logprobs: None for the first prompt token, then a dict per token with the same ids, logprobs, ranks
    and texts as the server's prompt_logprobs for the same engine output."""
    prompt = text_llm.tokenizer("The quick brown fox jumps").input_ids
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=4)
    got = text_llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    text_llm.engine.add_request("server-view", prompt, params)
    finished = []
    while text_llm.engine.has_unfinished_requests():
        finished += [o for o in text_llm.engine.step() if o.finished]
    served = prompt_logprobs_json(text_llm.tokenizer, finished[0].prompt_logprobs)
    assert len(got) == len(prompt) and got[0] is None and served[0] is None
    ref = _reference(text_llm, prompt)
    for pos in range(1, len(prompt)):
        assert {str(tid): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
                for tid, e in got[pos].items()} == served[pos]
        assert list(got[pos])[0] == prompt[pos]
        lo, hi = _rank_bounds(ref[pos - 1], prompt[pos])
        assert lo <= got[pos][prompt[pos]].rank <= hi


def test_detokenize_false_leaves_decoded_token_none(text_llm):
    prompt = text_llm.tokenizer("The quick").input_ids
    params = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    bare = text_llm.generate(prompt, SamplingParams(detokenize=False, **params), use_tqdm=False)[0]
    decoded = text_llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]
    steps = bare.outputs[0].logprobs + bare.prompt_logprobs[1:]
    assert all(e.decoded_token is None for step in steps for e in step.values())
    # the same entries otherwise
    strip = [{t: dataclasses.replace(e, decoded_token=None) for t, e in s.items()}
             for s in decoded.outputs[0].logprobs + decoded.prompt_logprobs[1:]]
    assert steps == strip


def test_without_a_tokenizer_decoded_token_is_none(tiny_llm):
    out = tiny_llm().generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, logprobs=1,
                                                        prompt_logprobs=1), use_tqdm=False)[0]
    entries = [e for step in out.outputs[0].logprobs + out.prompt_logprobs[1:] for e in step.values()]
    assert entries and all(e.decoded_token is None and e.rank is not None for e in entries)


def test_minus_one_needs_max_logprobs_minus_one(tiny_llm):
    """vLLM reads -1 as the vocabulary's size, over the default max_logprobs 20; below -1 stays an error."""
    for name in ("logprobs", "prompt_logprobs"):
        assert getattr(SamplingParams(**{name: -1}), name) == -1
        with pytest.raises(SamplingParamsError, match=f"{name} must be non-negative or -1"):
            SamplingParams(**{name: -2})
    capped = tiny_llm(max_num_seqs=2)
    vocab = capped.engine.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamsError, match=rf"{name} is -1, the whole vocabulary \({vocab} tokens\), "
                                                      r"more than max_logprobs 20"):
            capped.generate([1, 2, 3], SamplingParams(max_tokens=1, **{name: -1}), use_tqdm=False)
    # a cap at the vocabulary's size lets it through
    fits = tiny_llm(max_num_seqs=2, max_logprobs=vocab)
    out = fits.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab


def test_logprob_is_exported_and_frozen():
    assert radiance.Logprob is Logprob and "Logprob" in radiance.__all__
    entry = Logprob(-0.5, 1, "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.rank = 2  # type: ignore[misc]
    assert Logprob(-0.5) == Logprob(-0.5, None, None)  # vLLM's defaults


def test_the_engine_refuses_minus_one_before_its_step(tiny_llm):
    """SamplingParams(logprobs=-1) given to the engine itself (not through LLM, which reads it as the vocabulary)
    reached topk(-1) inside the step: a RuntimeError that stops the async engine for every request."""
    llm = tiny_llm(max_num_seqs=2)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} is -1: the engine takes a count"):
            llm.engine.check_request([1, 2, 3], SamplingParams(max_tokens=2, **{field: -1}))
