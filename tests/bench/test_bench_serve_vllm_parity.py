"""`radiance bench serve` reports what `vllm bench serve` reports, computed the same way: its peaks (per-second
buckets), its ShareGPT sampling (shuffled by --seed), its timing (one inter-token gap per streamed chunk, the
end-to-end latency at the last chunk with a choice) and its input tokens (the server's usage, else the client's
count). The streams are scripted with a clock they set themselves, so every number is exact."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from radiance.bench import metrics, serve_bench, serve_prompts
from radiance.bench.serve_bench import RequestResult, ServeBenchOptions
from radiance.bench.serve_prompts import PromptSpec

MODEL = "m"


# ------------------------------------------------------------------ peaks


def test_peaks_are_vllm_s_per_second_buckets():
    # request A sent at 10.0: tokens at 10.2, 10.5, 10.8, 11.1 (seconds 0, 0, 0, 1); ends at 11.1
    # request B sent at 10.5: tokens at 10.7, 10.8, 10.9 (second 0); ends at 10.9
    starts, ttfts, itls, latencies = [10.0, 10.5], [0.2, 0.2], [[0.3] * 3, [0.1] * 2], [1.1, 0.4]
    assert metrics.peak_output_tokens_per_second(starts, ttfts, itls, latencies) == 6.0
    assert metrics.peak_concurrent_requests(starts, latencies) == 2  # both in second 0, A alone in second 1
    # vLLM counts a request in every second it touches: two that follow each other within one second are "2"
    assert metrics.peak_concurrent_requests([0.0, 0.3], [0.2, 0.2]) == 2
    assert metrics.peak_concurrent_requests([0.0, 1.5], [0.2, 0.2]) == 1
    assert (metrics.peak_output_tokens_per_second([], [], [], []), metrics.peak_concurrent_requests([], [])) == (0.0, 0)


def _ok(start, ttft, itl, e2e):
    return RequestResult(ok=True, start_s=start, ttft_s=ttft, itl_s=itl, e2e_s=e2e, output_tokens=len(itl) + 1,
                         prompt_tokens=5, requested_tokens=len(itl) + 1)


def test_the_vllm_block_and_result_keys_carry_the_peaks():
    results = [_ok(10.0, 0.2, [0.3] * 3, 1.1), _ok(10.5, 0.2, [0.1] * 2, 0.4),
               RequestResult(ok=False, error="HTTP 500", start_s=10.1)]  # a failed request is in no bucket
    lv = serve_bench.summarize_level(2, results, 1.2).as_dict()
    assert (lv["peak_output_tok_s"], lv["peak_concurrency"]) == (6.0, 2)
    v = serve_bench.vllm_metrics(lv)
    assert (v["max_output_tokens_per_s"], v["max_concurrent_requests"]) == (6.0, 2)
    lines = serve_bench.vllm_summary(v, ("ttft",), (99.0,)).splitlines()
    labels = [line[:40].strip() for line in lines]
    at = labels.index("Output token throughput (tok/s):")
    assert labels[at + 1:at + 4] == ["Peak output token throughput (tok/s):", "Peak concurrent requests:",
                                     "Total token throughput (tok/s):"]  # vLLM's order
    assert lines[at + 1].split()[-1] == "6.00" and lines[at + 2].split()[-1] == "2.00"  # vLLM prints 2 as 2.00


def test_a_result_from_before_the_peaks_prints_without_them():
    lv = serve_bench.summarize_level(1, [_ok(0.0, 0.1, [0.1], 0.2)], 1.0).as_dict()
    v = serve_bench.vllm_metrics(lv)
    del v["max_output_tokens_per_s"], v["max_concurrent_requests"]
    assert "Peak" not in serve_bench.vllm_summary(v, ("ttft",), (99.0,))


# ------------------------------------------------------------------ one scripted stream


CHAT_SCRIPT = [  # (the clock when the event arrives, the event); the request is sent at 0.0
    (1.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),  # role only
    (1.5, {"choices": [{"index": 0, "delta": {"content": "a"}}]}),
    (2.5, {"choices": [{"index": 0, "delta": {"content": "bc"}}]}),  # two tokens in one chunk
    (3.0, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),  # the finish alone
    (8.0, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
    (9.0, "[DONE]"),
]


def _send(monkeypatch, script, prompt_len=None, **options) -> RequestResult:
    """One request against a server that streams `script`, each event arriving at its own clock time."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    async def events():
        for at, event in script:
            clock[0] = at
            yield f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()

    def handler(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    opts = ServeBenchOptions(url="http://t", model=MODEL, endpoint="chat", progress=False, warmup=0, **options)

    async def send():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t") as client:
            spec = PromptSpec("hi", 3) if prompt_len is None else PromptSpec("hi", 3, prompt_len=prompt_len)
            return await serve_bench.send_request(client, opts, MODEL, spec)

    result = asyncio.run(send())
    assert result.ok, result.error
    return result


def test_a_vllm_line_times_every_chunk_with_a_choice(monkeypatch):
    """vLLM's request function: TTFT at the first event with a choice (the role-only delta too), one ITL entry per
    later such event, the whole gap even for a chunk of two tokens, and the latency at the last of them."""
    res = _send(monkeypatch, CHAT_SCRIPT, vllm_form=True)
    assert res.ttft_s == 1.0 and res.itl_s == [0.5, 1.0, 0.5] and res.e2e_s == 3.0
    assert res.output_tokens == 3 and res.tpot_s == pytest.approx((3.0 - 1.0) / 2)


def test_radiance_s_line_times_tokens_and_ends_where_vllm_does(monkeypatch):
    """radiance's own timing: to the first text, a chunk of two tokens two gaps of half its delay; the end-to-end
    latency ended at the stream's end ([DONE] at 9.0, after the usage chunk), vLLM's at the last choice (3.0)."""
    res = _send(monkeypatch, CHAT_SCRIPT)
    assert res.ttft_s == 1.5 and res.itl_s == [0.5, 0.5] and res.e2e_s == 3.0


@pytest.mark.parametrize("vllm_form", [True, False])
def test_input_tokens_are_the_server_s_else_the_client_s_count(monkeypatch, vllm_form):
    """vLLM counts the server's usage.prompt_tokens (its chat template included) and falls back to the prompt's
    client-side count; without usage the request had no input tokens."""
    assert _send(monkeypatch, CHAT_SCRIPT, prompt_len=2, vllm_form=vllm_form).prompt_tokens == 7
    no_usage = [(at, e) for at, e in CHAT_SCRIPT if not (isinstance(e, dict) and "usage" in e)]
    assert _send(monkeypatch, no_usage, prompt_len=2, vllm_form=vllm_form).prompt_tokens == 2
    assert _send(monkeypatch, no_usage, vllm_form=vllm_form).prompt_tokens is None  # counted nowhere


def test_fitted_and_sharegpt_prompts_carry_their_token_counts(tmp_path):
    def client():
        def handler(request):
            return httpx.Response(200, json={"count": len(json.loads(request.content)["prompt"].split())})
        return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t")

    async def counted():
        async with client() as c:
            fitted = await serve_prompts.fit_to_tokens(c, MODEL, serve_prompts.random_prompts(2, 9, 4, 0), 12, 0)
            pool = [PromptSpec("one two three four five", 8, reply="a b c d")]
            return fitted, await serve_prompts.sharegpt_lengths(c, MODEL, pool, 1)

    fitted, sharegpt = asyncio.run(counted())
    assert [s.prompt_len for s in fitted] == [12, 12] and sharegpt[0].prompt_len == 5


# ------------------------------------------------------------------ ShareGPT sampling


def _conv(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def _sharegpt(tmp_path):
    rows = [_conv(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(8)]
    rows[2] = _conv(("human", "alone"))  # one turn: vLLM drops it before the shuffle
    rows[5] = _conv(("gpt", "the model opens"), ("human", "a reply"))  # vLLM takes turn 0 as the prompt
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    return path, rows


def _vllm_order(rows, seed):
    """vLLM's ShareGPTDataset.load_data and sample, by its own calls: the global random module seeded, then shuffled."""
    data = [r for r in rows if "conversations" in r and len(r["conversations"]) >= 2]
    state = random.getstate()
    try:
        random.seed(seed)
        random.shuffle(data)
    finally:
        random.setstate(state)
    return [(r["conversations"][0]["value"], r["conversations"][1]["value"]) for r in data]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_vllm_line_samples_sharegpt_as_vllm_does(tmp_path, seed):
    path, rows = _sharegpt(tmp_path)
    specs = serve_prompts.load_dataset(str(path), 128, shuffle_seed=seed)
    assert [(s.prompt, s.reply) for s in specs] == _vllm_order(rows, seed)


def test_radiance_s_line_walks_the_file_in_order(tmp_path):
    path, _ = _sharegpt(tmp_path)
    specs = serve_prompts.load_dataset(str(path), 128)
    # the first human turn and the turn after it, in the file's order (the one-turn row has no reply)
    assert [s.prompt for s in specs] == [f"question {i}" for i in range(2)] + ["alone"] + [
        f"question {i}" for i in (3, 4)] + ["a reply"] + [f"question {i}" for i in (6, 7)]


def test_a_vllm_run_sends_the_shuffled_prompts_and_reports_the_peaks(monkeypatch, tmp_path):
    path, rows = _sharegpt(tmp_path)
    sent = []

    async def send_request(client, opts, model, spec):
        sent.append(spec.prompt)
        return RequestResult(ok=True, requested_tokens=spec.output_len, output_tokens=1)

    monkeypatch.setattr(serve_bench, "send_request", send_request)
    opts = ServeBenchOptions(url="http://x", model=MODEL, concurrency=(4,), num_prompts=4, output_len=2,
                             dataset=str(path), progress=False, warmup=0, seed=3, vllm_form=True)
    result = serve_bench.run_serve_bench(opts)
    assert sent == [prompt for prompt, _ in _vllm_order(rows, 3)[:4]]
    assert {"max_output_tokens_per_s", "max_concurrent_requests"} <= result.keys()
