"""vLLM's request-phase and per-step metrics on a real (tiny, CPU) engine: the first scheduling survives preemption,
the per-step histograms add up to the tokens computed and the gaps between tokens, and /metrics shows every
family (queue / prefill / decode / inference times, inter-token latency, tokens per step, request sizes, n,
cache_config_info) under both prefixes, consistent with the requests sent and the engine's configuration."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine
from tests.server.fake_engine import serve_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _run(engine, prompts, params=GREEDY):
    """Steps the engine until every prompt finished; (final outputs by id, times each request left the queue,
    the tokens each scheduling step computed)."""
    admissions: dict[str, list[float]] = {}
    steps: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(**options):
        waiting = {id(seq) for seq in engine.scheduler.waiting}
        scheduled = schedule(**options)
        now = time.monotonic()
        for s in scheduled:
            if id(s.seq) in waiting:
                admissions.setdefault(s.seq.request_id, []).append(now)
        if scheduled:
            steps.append(sum(s.num_new_tokens for s in scheduled))
        return scheduled

    engine.scheduler.schedule = recording_schedule
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final, admissions, steps


def test_a_preempted_request_keeps_its_first_scheduling(tiny_llm):
    engine = tiny_llm(max_num_seqs=16, num_gpu_blocks_override=12, max_num_batched_tokens=32).engine
    final, admissions, _ = _run(engine, _prompts(6))
    assert engine.stats().num_preemptions > 0
    readmitted = [rid for rid, times in admissions.items() if len(times) > 1]
    assert readmitted, admissions
    for rid in readmitted:
        first, again = admissions[rid][0], admissions[rid][1]
        times = final[rid].times
        # stamped in the step of its first admission, before the one that re-admitted it
        assert first <= times.first_scheduled < again, (rid, admissions[rid], times)
        assert times.first_scheduled <= times.first_token <= times.last_token


def test_step_histograms_add_up_to_the_tokens_computed_and_the_gaps(tiny_llm):
    engine = tiny_llm(max_num_seqs=4, enable_prefix_caching=False, max_num_batched_tokens=64).engine
    prompts = _prompts(6, seed=3)
    final, _, steps = _run(engine, prompts)
    stats = engine.stats()
    assert stats.num_preemptions == 0
    generated = [len(final[f"r{i}"].token_ids) for i in range(len(prompts))]
    tokens = stats.iteration_tokens
    assert sum(tokens.counts) == len(steps) > 0
    # each prompt once, each output token but the last fed back (no prefix cache, no preemption)
    assert tokens.sum == sum(steps) == sum(len(p) + g - 1 for p, g in zip(prompts, generated))
    assert tokens.counts[0] == sum(1 for n in steps if n <= tokens.bounds[0])
    gaps = stats.inter_token_latency
    assert sum(gaps.counts) == sum(g - 1 for g in generated)
    decode = sum(out.times.last_token - out.times.first_token for out in final.values())
    assert gaps.sum == pytest.approx(decode, rel=1e-9, abs=1e-9)  # each request's gaps span its decode


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, its labels but model_name as a sorted tuple) -> value; asserts every series names the model."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == "fake", s
            samples[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return samples


@pytest.mark.parametrize("prefix", ["radiance_", "vllm:"])
def test_metrics_show_vllms_request_and_step_families(tiny_text_llm, prefix):
    engine = tiny_text_llm(max_num_seqs=4, enable_prefix_caching=False).engine
    assert engine.max_model_len == 512
    async_engine = AsyncLLMEngine(engine=engine)
    rng = random.Random(7)
    bodies = [  # (body, prompts, n): the engine requests are each prompt's n choices, ignore_eos: max_tokens each
        ({"prompt": [rng.randrange(250) for _ in range(9)], "max_tokens": 6}, 1, 1),
        ({"prompt": [rng.randrange(250) for _ in range(20)], "max_tokens": 4, "n": 2, "stream": True}, 1, 2),
        ({"prompt": [[rng.randrange(250) for _ in range(5)], [rng.randrange(250) for _ in range(13)]],
          "max_tokens": 3, "n": 2}, 2, 2),
        ({"prompt": [rng.randrange(250) for _ in range(31)], "max_tokens": 8}, 1, 1),
    ]

    async def send(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            # n > 1 samples (with a seed): greedy choices are refused, as vLLM refuses them
            answers = await asyncio.gather(*[client.post("/v1/completions", json={
                **body, "ignore_eos": True, "temperature": 0 if body.get("n", 1) == 1 else 1.0, "seed": 0})
                for body, _, _ in bodies])
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]

    with serve_engine(async_engine, metrics_prefix=prefix) as url:
        asyncio.run(send(url))
        deadline = time.monotonic() + 20
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        samples = _samples(httpx.get(url + "/metrics").text)

    def value(name, **labels):
        return samples[prefix + name, tuple(sorted(labels.items()))]

    jobs = [(body["prompt"] if n_prompts == 1 else body["prompt"][p], body["max_tokens"])
            for body, n_prompts, n in bodies for p in range(n_prompts) for _ in range(n)]
    prompts = [(n, body["max_tokens"]) for body, n_prompts, n in bodies for _ in range(n_prompts)]
    assert value("request_success_total", finished_reason="length") == len(jobs)

    # sizes: each engine request's, and each prompt's (n, its longest choice)
    assert value("request_prompt_tokens_count") == len(jobs)
    assert value("request_prompt_tokens_sum") == sum(len(p) for p, _ in jobs)
    assert value("request_generation_tokens_sum") == sum(m for _, m in jobs)
    assert value("request_params_max_tokens_sum") == sum(m for _, m in jobs)
    assert value("request_params_n_count") == len(prompts) and value("request_params_n_sum") == sum(
        n for n, _ in prompts)
    assert value("request_max_num_generation_tokens_sum") == sum(m for _, m in prompts)
    les = sorted(float(dict(labels)["le"]) for name, labels in samples
                 if name == prefix + "request_prompt_tokens_bucket")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")]  # vLLM's 1-2-5 up to max_model_len

    # tokens per step: each prompt once and each output token but the last (no prefix cache, no preemption)
    assert value("iteration_tokens_total_sum") == sum(len(p) + m - 1 for p, m in jobs)
    steps = value("iteration_tokens_total_count")
    assert max(m for _, m in jobs) <= steps == value("iteration_tokens_total_bucket", le="+Inf")
    assert value("iteration_tokens_total_bucket", le="1.0") <= value("iteration_tokens_total_bucket", le="8.0")
    assert value("inter_token_latency_seconds_count") == sum(m - 1 for _, m in jobs)

    # phases: one per engine request; inference = prefill + decode; the engine's decode spans the gaps; the
    # server saw the first token after queue + prefill and ended each request after its last token
    phases = {name: value(f"request_{name}_time_seconds_sum") for name in ("queue", "prefill", "decode", "inference")}
    for name in phases:
        assert value(f"request_{name}_time_seconds_count") == len(jobs)
        assert phases[name] >= 0
    assert phases["prefill"] > 0 and phases["decode"] > 0
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    assert phases["decode"] == pytest.approx(value("inter_token_latency_seconds_sum"), abs=1e-6)
    assert phases["queue"] + phases["prefill"] <= value("time_to_first_token_seconds_sum")
    assert phases["queue"] + phases["inference"] <= value("e2e_request_latency_seconds_sum")

    cache = engine.config.cache
    [(name, labels)] = [key for key in samples if key[0] == prefix + "cache_config_info"]
    assert samples[name, labels] == 1
    assert dict(labels) == {"block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
                            "enable_prefix_caching": "False",
                            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
                            "num_gpu_blocks": str(engine.runner.num_blocks), "num_gpu_blocks_override": "None"}
