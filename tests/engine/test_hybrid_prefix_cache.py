"""Prefix caching for a model with recurrent state (Qwen3.5, Qwen3-Next): the states kept where prefill chunks end on
a block boundary (state_cache.PrefixStates), a hit cut back to the last block with kept states, and answers equal to
transformers' whether a prompt was computed or continued from a cached prefix."""

from __future__ import annotations

import pytest
import torch

from radiance import LLM, SamplingParams
from radiance.engine.state_cache import PrefixStates

HYBRIDS = ["qwen3_5", "qwen3_next"]


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(llm: LLM, prompt: list[int], new_tokens: int, salt: str | None = None):
    """(the greedy answer, the tokens its prompt took from the prefix cache, each step's chunk of it)."""
    engine, chunks = llm.engine, []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        scheduled = schedule(*args, **kwargs)
        chunks.extend(s.num_new_tokens for s in scheduled if s.seq.request_id == "r")
        return scheduled

    engine.scheduler.schedule = recording
    try:
        engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                                       cache_salt=salt))
        seq = engine.sequences["r"]
        answer = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    answer = out.token_ids
    finally:
        engine.scheduler.schedule = schedule
    return answer, seq.num_cached_tokens, chunks[:len(chunks) - new_tokens + 1]


@pytest.mark.parametrize("model", HYBRIDS)
@pytest.mark.parametrize("budget, chunks, kept", [(None, [150], 1), (40, [32, 32, 32, 32, 22], 4)])
def test_a_repeated_prompt_continues_from_its_cached_states(tiny_model_dir, model, budget, chunks, kept):
    """A 150-token prompt keeps its states at 128: whole, from inside its one step (the last whole 64-token chunk
    of the delta rule before its final token); in 40-token steps, each chunk short of the end cut on a block
    boundary (16 tokens) and kept after its step: 32, 64, 96, 128. Sent again it takes 128 tokens from the cache,
    states included, and computes 22; both answers are transformers'. Another cache salt finds nothing."""
    path, hf = tiny_model_dir(model)
    options = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(path, device="cpu", dtype="float32", **options)
    prompt = _prompt(150, seed=1)
    want = _hf_greedy(hf, prompt, 8)
    assert _run(llm, prompt, 8) == (want, 0, chunks)
    assert _run(llm, prompt, 8) == (want, 128, [22])
    prefix = llm.engine.block_manager.prefix_states
    assert prefix.restores == 1 and prefix.num_kept == kept
    assert _run(llm, prompt, 8, salt="other") == (want, 0, chunks)


def test_a_follow_up_turn_continues_from_the_first_turns_prompt(tiny_model_dir):
    """A second turn (the first prompt, its answer, a new message) takes the first prompt's cached prefix up to the
    states kept inside its step (192 of 200 tokens) and answers as transformers does on the whole conversation."""
    path, hf = tiny_model_dir("qwen3_5")
    llm = LLM(path, device="cpu", dtype="float32")
    first = _prompt(200, seed=2)
    answer, _, _ = _run(llm, first, 10)
    second = first + answer + _prompt(9, seed=3)
    assert _run(llm, second, 10)[:2] == (_hf_greedy(hf, second, 10), 192)


@pytest.mark.parametrize("prefix_states, hit", [(1, 0), (2, 32), (3, 32)])
def test_a_hit_is_cut_back_to_the_last_block_whose_states_were_kept(tiny_model_dir, prefix_states, hit):
    """A 70-token prompt in 32-token steps keeps its states at 32 and 64 (its last boundary before the final token).
    A prompt sharing its first 50 tokens finds their first 48 in the KV cache, but states only at 32, or none once
    the single row kept for the prefix cache went to 64: its hit ends there, and its answer is transformers'."""
    path, hf = tiny_model_dir("qwen3_5")
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=32, prefix_states=prefix_states)
    first = _prompt(70, seed=4)
    _run(llm, first, 2)
    second = first[:50] + _prompt(12, seed=5)
    assert _run(llm, second, 6)[:2] == (_hf_greedy(hf, second, 6), hit)


def test_prefix_caching_off_leaves_the_chunks_whole(tiny_model_dir):
    """Without prefix caching (or with no prefix state to keep) nothing is kept and chunks are not cut."""
    path, _ = tiny_model_dir("qwen3_5")
    for options in ({"enable_prefix_caching": False}, {"prefix_states": 0}):
        llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=20, **options)
        assert llm.engine.block_manager.prefix_states is None and not llm.engine.config.cache.enable_prefix_caching
        assert _run(llm, _prompt(45, seed=1), 3)[1:] == (0, [20, 20, 5])
        assert _run(llm, _prompt(45, seed=1), 3)[1] == 0


def test_prefix_states_keep_the_least_recently_used_out():
    """Two rows for three prefixes: a save takes a free row, then the least recently used one (a restore counts
    as a use); a prefix kept already is only touched, not copied again."""
    copies = []
    states = PrefixStates(range(8, 10), lambda src, dst: copies.append((src, dst)))
    states.save(0, b"a")
    states.save(1, b"b")
    states.restore(b"a", 5)
    states.save(2, b"c")  # b is the least recently used
    states.save(3, b"a")
    assert copies == [(0, 8), (1, 9), (8, 5), (2, 9)]
    assert b"a" in states and b"c" in states and b"b" not in states and states.num_kept == 2
    assert (states.saves, states.restores) == (3, 1)
    row = states.reserve()  # a step's row: c's, the least recently used since a was touched
    assert row == 9 and b"c" not in states and b"a" in states
    states.publish(b"a", row)  # a is kept already: the row goes back
    assert states.reserve() == 9 and states.num_kept == 1


def test_a_preempted_sequence_resumes_from_its_own_cached_states(tiny_model_dir):
    """A cache of 8 blocks for four growing sequences: the preempted ones are recomputed, taking what their own
    earlier chunks kept (states and blocks not yet handed out again), and still answer as transformers does."""
    path, hf = tiny_model_dir("qwen3_5")
    prompts = [_prompt(30 + 3 * i, seed=9 + i) for i in range(4)]
    llm = LLM(path, device="cpu", dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=32,
              max_model_len=96)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [_hf_greedy(hf, p, 30) for p in prompts]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_states.restores > 0
    assert engine.block_manager.state_slots.num_free == engine.block_manager.state_slots.count


def test_more_saves_in_a_step_than_rows_keep_what_fits(tiny_model_dir):
    """One row for the prefix cache, three 150-token prompts in one step (each would keep its states at 128): the
    first takes the row, the others keep nothing, and every answer is transformers'. Sent again, the first prompt
    continues from its states."""
    path, hf = tiny_model_dir("qwen3_5")
    llm = LLM(path, device="cpu", dtype="float32", prefix_states=1)
    prompts = [_prompt(150, seed=20 + i) for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [_hf_greedy(hf, p, 4) for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.block_manager.prefix_states.num_kept == 1
    again = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[:2]
    assert [o.num_cached_tokens for o in again] == [128, 0]
