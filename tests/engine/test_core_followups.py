"""Engine follow-ups: cumulative_logprob as vLLM reports it, no preemption churn when KV blocks run out,
best_of refused as vLLM v1 does."""

from __future__ import annotations

import asyncio
import random

import pytest

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine

PROMPT = [5, 9, 9, 200, 17, 3, 41, 250, 7]


# ---------------------------------------------------------------- cumulative_logprob

def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(tiny_llm):
    llm = tiny_llm(max_num_seqs=4)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(n=2, max_tokens=6, seed=3, ignore_eos=True, logprobs=0)
    outs = [o for r in llm.generate([PROMPT, PROMPT], [greedy, sampled]) for o in r.outputs]
    assert len(outs) == 3
    for out in outs:
        assert len(out.logprobs) == 6
        sampled = [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)]
        assert out.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-5)
        assert out.cumulative_logprob < 0
    # vLLM v1: None when logprobs are not requested
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))[0].outputs[0]
    assert plain.cumulative_logprob is None


def test_the_async_engine_streams_the_cumulative_logprob(tiny_llm):
    engine = AsyncLLMEngine(engine=tiny_llm(max_num_seqs=4).engine)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)

    async def collect():
        return [out async for out in engine.generate("c", PROMPT, params)]

    outs = asyncio.run(collect())
    assert outs[-1].finished and len(outs[-1].logprobs) == 5
    for out in outs:  # each streamed output: the sum so far
        assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs), abs=1e-5)


# ---------------------------------------------------------------- preemption churn

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _generate_counting(llm, prompts):
    """The outputs, and the tokens the model computed for them (recomputes after preemption included)."""
    scheduler = llm.engine.scheduler
    schedule, computed = scheduler.schedule, [0]

    def counting(**options):
        scheduled = schedule(**options)
        computed[0] += sum(s.num_new_tokens for s in scheduled)
        return scheduled

    scheduler.schedule = counting
    try:
        return [r.outputs[0] for r in llm.generate(prompts, LONG)], computed[0]
    finally:
        del scheduler.schedule


def test_a_tiny_kv_cache_preempts_without_churn(tiny_text_llm):
    """Four 40-token prompts, 40 tokens each, on 7 blocks of 16 tokens (one sequence needs 5). A preempted
    sequence was re-admitted into the blocks it had just freed, then preempted again before it sampled, over
    and over: 73 preemptions and 8 times the tokens computed. Now each sequence is preempted at most about
    once, and greedy outputs are those of a roomy cache."""
    rng = random.Random(7)
    prompts = [[rng.randrange(300) for _ in range(40)] for _ in range(4)]
    roomy, roomy_computed = _generate_counting(tiny_text_llm(max_num_seqs=8, enable_prefix_caching=False), prompts)
    llm = tiny_text_llm(max_num_seqs=8, num_gpu_blocks_override=7, max_num_batched_tokens=32,
                        enable_prefix_caching=False)
    tight, computed = _generate_counting(llm, prompts)
    preemptions = llm.engine.stats().num_preemptions
    assert 0 < preemptions <= len(prompts)
    assert computed <= 2 * roomy_computed
    assert [o.finish_reason for o in tight] == ["length"] * len(prompts)
    assert [(o.token_ids, o.text) for o in tight] == [(o.token_ids, o.text) for o in roomy]
    assert len({o.text for o in tight}) == len(prompts)  # texts that can differ
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# ---------------------------------------------------------------- best_of

def test_best_of_is_refused_unless_it_equals_n(tiny_llm):
    """vLLM v1 removed best_of: a request for it is a ValueError naming it (it was a TypeError), and
    best_of == n (what v0 defaulted to) means nothing more than n."""
    for options in (dict(best_of=3), dict(n=2, best_of=4), dict(n=3, best_of=2)):
        with pytest.raises(ValueError, match="best_of is not supported"):
            SamplingParams(**options)
    with pytest.raises(ValueError, match="best_of must be an integer"):
        SamplingParams(best_of=2.0)
    llm = tiny_llm(max_num_seqs=4)
    out = llm.generate(PROMPT, SamplingParams(n=2, best_of=2, max_tokens=3, seed=1, ignore_eos=True))[0]
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
