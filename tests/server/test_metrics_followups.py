"""vLLM's newer per-request histograms on /metrics, through the server's routes: request_time_per_output_token_seconds
(each request's decode time over its tokens after the first, 0 with one token) and
request_prefill_kv_computed_tokens (each request's prompt less its prefix-cache hits), under both name prefixes.

The engine is the scripted FakeEngine, stamping its outputs with the times and cached prompt tokens a real engine
reports, so each request's expected value is known exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest

from radiance.engine.outputs import RequestTimes
from tests.engine.test_metrics_vllm_parity import _samples
from tests.server.fake_engine import FakeEngine, serve_engine

STEP = 0.125  # scripted seconds between a request's tokens, per token of its prompt (exact in binary)


class TimedEngine(FakeEngine):
    """Stamps each output as the engine does: scheduled at once, the first token 1 s later, each next one
    STEP * len(prompt) s after it; and finds a quarter of every prompt (rounded down) in its prefix cache."""

    def __init__(self):
        super().__init__()
        # request id -> (prompt tokens, cached, tokens generated, times) of its last output
        self.final: dict[str, tuple[int, int, int, RequestTimes]] = {}

    async def generate(self, request_id, prompt_token_ids, params):
        start, cached, step = time.monotonic(), len(prompt_token_ids) // 4, STEP * len(prompt_token_ids)
        async for out in super().generate(request_id, prompt_token_ids, params):
            n = len(out.token_ids)
            times = RequestTimes(first_scheduled=start, first_token=start + 1.0, last_token=start + 1.0 + step * (n - 1))
            out = dataclasses.replace(out, times=times, num_cached_tokens=cached)
            self.final[request_id] = (len(prompt_token_ids), cached, n, times)
            yield out


@pytest.mark.parametrize("prefix", ["radiance_", "vllm:"])
def test_per_request_tpot_and_prefill_computed_tokens_add_up(prefix):
    engine = TimedEngine()
    bodies = [  # (route, body): 1 + 2 + 2 + 1 + 1 engine requests, one of them a single token
        ("/v1/completions", {"prompt": "SAY:hello", "max_tokens": 16}),
        ("/v1/completions", {"prompt": ["SAY:ab", "SAY:a much longer prompt"], "max_tokens": 16, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:two choices"}], "n": 2}),
        ("/v1/completions", {"prompt": "SAY:x", "max_tokens": 1}),
        ("/v1/responses", {"input": "SAY:a response"}),
    ]

    async def send(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers = await asyncio.gather(*[client.post(path, json={"model": "fake", **body})
                                             for path, body in bodies])
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]

    with serve_engine(engine, metrics_prefix=prefix) as url:
        asyncio.run(send(url))
        samples = _samples(httpx.get(url + "/metrics", timeout=30).text)

    def value(name, **labels):
        return samples[prefix + name, tuple(sorted(labels.items()))]

    requests = list(engine.final.values())
    assert len(requests) == 7 and sorted(n for _, _, n, _ in requests)[:2] == [1, 2]

    # TPOT per request: decode / (tokens - 1), 0 for the one-token request; one observation per engine request
    tpots = [(t.last_token - t.first_token) / (n - 1) if n > 1 else 0.0 for _, _, n, t in requests]
    assert value("request_time_per_output_token_seconds_count") == len(requests)
    assert value("request_time_per_output_token_seconds_sum") == pytest.approx(sum(tpots))
    assert value("request_time_per_output_token_seconds_sum") == pytest.approx(
        sum(STEP * prompt for prompt, _, n, _ in requests if n > 1))
    # each one's bucket: decode over the tokens after the first is the scripted step, the one-token request's 0
    assert value("request_time_per_output_token_seconds_bucket", le="0.001") == 1
    assert value("request_time_per_output_token_seconds_bucket", le="+Inf") == len(requests)
    # it divides the decode phase (same clock, same requests) by each request's tokens after the first
    assert value("request_decode_time_seconds_sum") == pytest.approx(
        sum(tpot * (n - 1) for tpot, (_, _, n, _) in zip(tpots, requests)))

    # prefill computed tokens: each prompt less its cached tokens, so the prompt histogram's sum less this one's
    # is the prefix-cache hits; one observation per engine request, as request_prompt_tokens has
    computed = [prompt - cached for prompt, cached, _, _ in requests]
    assert value("request_prefill_kv_computed_tokens_count") == len(requests) == value("request_prompt_tokens_count")
    assert value("request_prefill_kv_computed_tokens_sum") == sum(computed)
    assert value("request_prompt_tokens_sum") - value("request_prefill_kv_computed_tokens_sum") == sum(
        cached for _, cached, _, _ in requests) > 0
    les = sorted(float(dict(labels)["le"]) for name, labels in samples
                 if name == prefix + "request_prefill_kv_computed_tokens_bucket")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")]  # vLLM's 1-2-5 up to max_model_len (512)


def test_both_show_empty_before_any_request():
    """Like vLLM's, the families are there (count 0) from the start, once the model is loaded."""
    with serve_engine(FakeEngine()) as url:
        samples = _samples(httpx.get(url + "/metrics", timeout=30).text)
    assert samples["radiance_request_time_per_output_token_seconds_count", ()] == 0
    assert samples["radiance_request_prefill_kv_computed_tokens_count", ()] == 0


def caching_tiny_llama(tmp_path):
    """The tiny random Llama 3 (no BOS) saved under tmp_path, on a CPU engine with prefix caching: (the engine, the
    AsyncLLMEngine around it for serve_engine)."""
    from radiance import LLM
    from radiance.engine.async_engine import AsyncLLMEngine
    from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer, tiny_hf_model

    tokenizer = tiny_byte_bpe_tokenizer()
    model = tiny_hf_model("llama3", seed=1, vocab_size=TINY_TOKENIZER_VOCAB)
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id = None, tokenizer.eos_token_id
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = LLM(str(tmp_path), device="cpu", dtype="float32", enable_prefix_caching=True).engine
    return engine, AsyncLLMEngine(engine=engine)


def test_a_real_engines_prefix_cache_hits_are_what_the_prompts_did_not_compute(tmp_path):
    """The tiny random Llama 3 with prefix caching, behind the server: the same prompt a second time finds its
    full blocks cached, and request_prompt_tokens_sum less request_prefill_kv_computed_tokens_sum is the
    engine's own prefix_cache_hits count; each request's TPOT times its tokens after the first gives back the
    decode phase."""
    engine, served = caching_tiny_llama(tmp_path)
    shared = list(range(1, 41))  # 40 tokens: two and a half blocks of 16
    prompts = [shared, shared, shared[:20] + [7] * 9, list(range(100, 117))]
    with serve_engine(served) as url:
        for prompt in prompts:  # one at a time: each finds what the ones before left in the cache
            r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 4,
                                                          "ignore_eos": True, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
        samples = _samples(httpx.get(url + "/metrics", timeout=30).text)
        hits = engine.stats().prefix_cache_hits_total

    def value(name):
        return samples["radiance_" + name, ()]

    assert hits >= 32 + 16  # the repeated prompt's two full blocks, the third prompt's first one
    assert value("request_prefill_kv_computed_tokens_count") == len(prompts)
    assert value("request_prompt_tokens_sum") == sum(map(len, prompts))
    assert value("request_prompt_tokens_sum") - value("request_prefill_kv_computed_tokens_sum") == hits
    assert value("request_time_per_output_token_seconds_count") == len(prompts)
    # every request made 4 tokens: its TPOT is its decode over 3
    assert 3 * value("request_time_per_output_token_seconds_sum") == pytest.approx(
        value("request_decode_time_seconds_sum"), rel=1e-9, abs=1e-9)
