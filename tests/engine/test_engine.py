"""Scheduling must not change what greedy decoding produces; sampling options behave as documented."""

from __future__ import annotations

import random

import numpy
import pytest

from radiance import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """Each prompt generated alone on a roomy, unchunked, uncached engine."""
    llm = tiny_llm(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_seqs=1)
    prompts = _prompts(6) + _prompts(4, seed=1, shared_prefix=40)
    return prompts, [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_outputs_have_the_requested_length(reference):
    _, outs = reference
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert len({tuple(o) for o in outs}) == len(outs)  # the model is not degenerate


@pytest.mark.parametrize("options", [
    dict(max_num_seqs=16),                                                   # continuous batch
    dict(max_num_seqs=16, enable_prefix_caching=True),                       # prefix cache hits
    dict(max_num_seqs=16, max_num_batched_tokens=16),                        # chunked prefill, mixed steps
    dict(max_num_seqs=16, enable_chunked_prefill=False, max_num_batched_tokens=64),
    dict(max_num_seqs=16, num_gpu_blocks_override=12, max_num_batched_tokens=32),  # preemption
    # decode steps queued before the previous step's tokens are read (on by default with CUDA graphs)
    dict(max_num_seqs=16, overlap_decode=True),
    dict(max_num_seqs=16, max_num_batched_tokens=16, overlap_decode=True),
    dict(max_num_seqs=16, num_gpu_blocks_override=12, max_num_batched_tokens=32, overlap_decode=True),
], ids=["batched", "prefix-cache", "chunked", "unchunked", "preemption", "overlap", "overlap-chunked",
        "overlap-preemption"])
def test_greedy_identical_under_scheduling(tiny_llm, reference, options):
    prompts, expected = reference
    llm = tiny_llm(**options)
    if options.get("enable_prefix_caching"):
        llm.generate(prompts[-1], GREEDY)  # warm the cache with the shared prefix
    outs = llm.generate(prompts, GREEDY)
    assert _ids(outs) == expected
    assert (llm.engine.overlapped_steps > 0) == bool(options.get("overlap_decode"))
    stats = llm.engine.stats()
    if "num_gpu_blocks_override" in options:
        assert stats.num_preemptions > 0
    if options.get("enable_prefix_caching"):
        assert max(o.num_cached_tokens for o in outs) >= 32
    assert stats.num_running == stats.num_waiting == 0


def test_prefix_caching_off_reuses_nothing(tiny_llm):
    llm = tiny_llm(enable_prefix_caching=False)
    prompts = _prompts(2, seed=3, shared_prefix=48)
    llm.generate(prompts[0], GREEDY)
    assert llm.generate(prompts[1], GREEDY)[0].num_cached_tokens == 0
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries_total == stats.prefix_cache_hits_total == 0  # no cache: nothing looked up


def test_prefix_cache_counters_count_each_requests_lookup_once(tiny_llm):
    """vLLM's prefix_cache_queries / hits (tokens): every prompt token at a request's first admission, and the
    cached ones among them."""
    llm = tiny_llm()
    prompts = _prompts(2, seed=3, shared_prefix=48)
    llm.generate(prompts[0], GREEDY)
    second = llm.generate(prompts[1], GREEDY)[0]
    stats = llm.engine.stats()
    assert second.num_cached_tokens >= 32
    assert stats.prefix_cache_queries_total == len(prompts[0]) + len(prompts[1])
    assert stats.prefix_cache_hits_total == second.num_cached_tokens


def test_seeded_sampling_is_reproducible(tiny_llm):
    llm = tiny_llm()
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    first = llm.generate(prompt, params)[0].outputs[0].token_ids
    # the same request again, now inside a batch of other sampled requests
    batch = llm.generate([prompt] + _prompts(3, seed=6), [params] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)
    assert batch[0].outputs[0].token_ids == first
    other = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True))
    assert other[0].outputs[0].token_ids != first


def test_stop_token_ids_and_max_model_len(tiny_llm, reference):
    prompts, expected = reference
    llm = tiny_llm(max_model_len=64)
    stop_at = expected[0][4]
    out = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    first = expected[0].index(stop_at)
    assert out.outputs[0].token_ids == expected[0][:first + 1]
    assert out.outputs[0].finish_reason == "stop"
    long_prompt = list(range(60))
    out = llm.generate(long_prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(list(range(64)), GREEDY)


def test_logprobs_are_consistent(tiny_llm):
    llm = tiny_llm()
    out = llm.generate(_prompts(1, seed=7)[0], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, step in zip(out.token_ids, out.logprobs):  # vLLM's {token id: Logprob}, the token first
        assert list(step)[0] == token
        assert len(step) == 3  # greedy: the token is the first of its 3 alternatives
        assert [e.rank for e in step.values()] == [1, 2, 3]
        first, second, third = (e.logprob for e in step.values())
        assert first >= second >= third
        assert first <= 0


def test_abort_and_stats(tiny_llm):
    llm = tiny_llm()
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.stats().num_running == 2 and engine.stats().kv_cache_usage > 0
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"a": "abort", "b": "length"}
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        engine.add_request("c", [], SamplingParams())


def test_generate_rejects_a_bad_prompt_before_queueing_any(tiny_llm):
    from radiance import SamplingParams

    llm = tiny_llm(max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    too_long = [1] * (llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match=f"has {len(too_long)} tokens; this model serves at most"):
        llm.generate([[1, 2, 3], too_long], params)
    assert not llm.engine.has_unfinished_requests()  # nothing left behind for the next call
    out = llm.generate([[1, 2, 3]], params)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def test_cli_bad_option_is_one_line_and_exit_code_2(capsys):
    from radiance.cli import main

    assert main(["generate", "hi", "--max-num-seqs", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs must be positive, got 0" in err and "Traceback" not in err


def test_overlapped_decode_survives_stops_aborts_and_sampling(tiny_llm, reference):
    """Sequences that stop on a token (unknown ahead), finish by length at different steps, get
    aborted, or sample (unseeded, seeded): the same outputs with and without steps queued ahead."""
    prompts, expected = reference

    def run(overlap: bool):
        engine = tiny_llm(max_num_seqs=8, overlap_decode=overlap).engine
        for i, p in enumerate(prompts[:6]):
            stop = (expected[i][3 + i % 4],) if i % 2 else ()
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, stop_token_ids=stop))
        engine.add_request("seeded", prompts[6], SamplingParams(max_tokens=9, temperature=1.0, seed=7, ignore_eos=True))
        engine.add_request("doomed", prompts[7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 5:
                engine.abort_request("doomed")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.finish_reason)
        return done, engine.overlapped_steps

    plain, none_ahead = run(False)
    overlapped, ahead = run(True)
    assert none_ahead == 0 and ahead > 0
    assert overlapped == plain
    assert plain["doomed"][1] == "abort" and {plain[f"r{i}"][1] for i in range(6)} == {"stop", "length"}


def test_fp8_kv_cache(tiny_llm):
    """kv_cache_dtype fp8 on the CPU: e4m3 blocks (a quarter of the float32 cache's bytes, so four times the
    blocks), scores that move off the exact cache's by fp8 rounding only, and the same tokens under chunked
    prefill and prefix-cache hits (every path reads K/V back from the cache)."""
    import torch

    exact, fp8 = tiny_llm(max_num_seqs=4), tiny_llm(max_num_seqs=4, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.num_blocks == 4 * exact.engine.runner.num_blocks
    prompts = [list(range(30, 70)), [5, 9, 9, 200, 17, 3, 3, 3, 41, 250, 7, 100, 64, 2, 88, 91, 12, 12, 0, 77]]
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    diffs = [abs(a[t].logprob - b[t].logprob)
             for p, o8, o32 in zip(prompts, fp8.generate(prompts, scored), exact.generate(prompts, scored))
             for t, a, b in zip(p[1:], o8.prompt_logprobs[1:], o32.prompt_logprobs[1:])]
    # a random tiny model reads e4m3 K/V (6% relative steps) with logprobs off by 0.06 on average here
    assert 0 < max(diffs) < 0.6 and sum(diffs) / len(diffs) < 0.15, (max(diffs), sum(diffs) / len(diffs))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    for options in (dict(max_num_batched_tokens=16), dict(enable_prefix_caching=True)):
        llm = tiny_llm(max_num_seqs=4, kv_cache_dtype="fp8", **options)
        llm.generate(prompts[0], SamplingParams(max_tokens=1))  # a cached prefix for the second run
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, options


def test_fp8_kv_cache_with_calibrated_scales(tiny_llm):
    """Calibrated KV scales (a checkpoint's k_scale / v_scale): the fp8 cache stores K / k and V / v and
    attention reads them back times k and v. Scales of 0.5 keep e4m3 rounding (a power of two, nothing near
    saturation) so scores match the unscaled cache's but for e4m3 subnormals, and the no-cache eval path
    with the same scales matches the served one; a k of 2^-8 saturates K (|K| past 1.75) and moves the
    scores."""
    import torch

    from radiance.layers.attention import KvScales

    prompt = list(range(30, 70))
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def served(scales):
        llm = tiny_llm(kv_cache_dtype="fp8")
        for attn in llm.engine.runner.model.attention_layers():
            attn.fp8_kv_scales = scales
        return llm, [e[t].logprob for t, e in zip(prompt[1:], llm.generate(prompt, scored)[0].prompt_logprobs[1:])]

    _, unscaled = served(KvScales())
    llm, halves = served(KvScales(0.5, 0.5))
    assert halves == pytest.approx(unscaled, abs=2e-2)  # (values below 2^-6 round differently)
    model = llm.engine.runner.model
    for attn in model.attention_layers():
        attn.kv_storage_dtype = torch.float8_e4m3fn
    rounded = model.forward_logits(torch.tensor([prompt]))[0].float().log_softmax(-1)
    assert halves == pytest.approx([rounded[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-4)
    _, saturated = served(KvScales(2.0 ** -8, 1.0))
    assert max(abs(a - b) for a, b in zip(saturated, unscaled)) > 0.05


def test_eval_variant_with_fp8_kv_matches_the_served_cache(tiny_llm):
    """`radiance eval`'s +fp8kv scores without a cache by rounding K/V as the fp8 cache stores them: its
    prompt scores equal the engine's with kv_cache_dtype fp8 (which reads them back from the cache)."""
    import torch

    llm = tiny_llm(kv_cache_dtype="fp8")
    prompt = list(range(30, 70))
    served = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    model = llm.engine.runner.model
    plain = model.forward_logits(torch.tensor([prompt]))[0].float().log_softmax(-1)
    for attn in model.attention_layers():
        attn.kv_storage_dtype = torch.float8_e4m3fn
    rounded = model.forward_logits(torch.tensor([prompt]))[0].float().log_softmax(-1)
    want = [rounded[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert [e[t].logprob for t, e in zip(prompt[1:], served[1:])] == pytest.approx(want, abs=1e-4)
    assert max(abs(a - plain[p - 1, prompt[p]].item()) for p, a in enumerate(want, start=1)) > 1e-3


def test_logprobs_past_the_vocabulary_are_refused_up_front(tiny_llm):
    """logprobs or prompt_logprobs above the vocabulary size failed inside the step (topk out of range) with a
    RuntimeError, which stopped the async engine for every request."""
    llm = tiny_llm(max_num_seqs=4, max_logprobs=-1)
    vocab = llm.engine.model.config.vocab_size
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=field):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **{field: vocab + 1}))
    every = SamplingParams(max_tokens=2, temperature=0.0, logprobs=vocab, prompt_logprobs=vocab)
    out = llm.generate([[1, 2, 3]], every)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab and len(out.prompt_logprobs[1]) == vocab


def test_any_integer_seed_is_served(tiny_llm):
    """torch takes 64-bit seeds: 2**70 raised "Overflow when unpacking long long", and n = 2 with the largest
    seed overflowed on the second choice's seed + 1. Seeds are taken modulo 2**64 (torch already wraps negatives)."""
    llm = tiny_llm(max_num_seqs=4)

    def run(seed, n=1):
        params = SamplingParams(n=n, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        return [c.token_ids for c in llm.generate([[1, 2, 3]], params)[0].outputs]

    assert run(2**70) == run(2**70) == run(2**70 % 2**64)
    assert run(-2) == run(2**64 - 2)  # -1 is vLLM's "no seed"
    assert run(2**64 - 1, n=2) == run(2**64 - 1) + run(0)


def test_generate_checks_its_arguments(tiny_llm):
    llm = tiny_llm(max_num_seqs=4)
    with pytest.raises(ValueError, match="0 sampling params for 1 prompts"):
        llm.generate([[1, 2, 3]], [])  # was served with the default parameters
    # a float id was truncated to a token, a tuple failed as "'int' object is not iterable", a dict of
    # parameters as "'dict' object has no attribute 'logit_bias'"
    for bad, match in (([[1.7, 2.2]], "a prompt must be"), ([[True, 3]], "a prompt must be"), (None, "prompts must be"),
                       ([[1, 2], {"ids": [1]}], "a prompt must be")):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        llm.generate([[1, 2, 3]], {"max_tokens": 2})
    assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    want = llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    for same in ((1, 2, 3), numpy.array([1, 2, 3]), [numpy.int64(1), 2, 3]):  # one prompt of token ids
        assert [o.outputs[0].token_ids for o in llm.generate(same, params)] == [want]
    for bad in ("hello", ["hello"], [("user", "hi")], [[{"content": "no role"}]]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad)
