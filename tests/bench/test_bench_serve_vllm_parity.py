"""`radiance bench serve` reports what `vllm bench serve` reports, computed the same way: its peaks (tokens in
one-second buckets, the exact peak of requests in flight), its ShareGPT sampling (shuffled by --seed unless
--disable-shuffle, sized and filtered by token counts with special tokens), what it counts as a success (any event
with a choice), its timing (one inter-token gap per streamed chunk, the end-to-end latency at the last chunk with a
choice) and its input tokens (the server's usage, else the client's count). The streams are scripted with a clock
they set themselves, so every number is exact."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time

import httpx
import pytest

from radiance.bench import metrics, serve_bench, serve_prompts
from radiance.bench.serve_bench import RequestResult, ServeBenchOptions
from radiance.bench.serve_prompts import PromptSpec

MODEL = "m"


# ------------------------------------------------------------------ peaks


def test_peaks_are_vllm_s_exact_concurrency_and_per_second_token_buckets():
    """vLLM main's calculate_metrics: "Peak output token throughput" is still the fullest one-second bucket of token
    times, "Peak concurrent requests" the exact most in flight at one instant over [send, end) (issue #56653), an
    end before a send at the same instant. The one-second buckets of concurrency counted two requests that followed
    each other within a second as 2, and 40 back-to-back requests at --max-concurrency 4 as 40."""
    # request A sent at 10.0: tokens at 10.2, 10.5, 10.8, 11.1 (seconds 0, 0, 0, 1); ends at 11.1
    # request B sent at 10.5: tokens at 10.7, 10.8, 10.9 (second 0); ends at 10.9
    starts, ttfts, itls, latencies = [10.0, 10.5], [0.2, 0.2], [[0.3] * 3, [0.1] * 2], [1.1, 0.4]
    assert metrics.peak_output_tokens_per_second(starts, ttfts, itls, latencies) == 6.0
    assert metrics.peak_concurrent_requests(starts, latencies) == 2  # B runs inside A
    assert metrics.peak_concurrent_requests([0.0, 0.3], [0.2, 0.2]) == 1  # one after the other, in one second
    assert metrics.peak_concurrent_requests([0.0, 0.25, 0.5, 0.75, 1.0], [0.25] * 5) == 1  # each ends as the next starts
    back_to_back = [i * 0.25 for i in range(10) for _ in range(4)]  # four at a time, each 0.25 s long
    assert metrics.peak_concurrent_requests(back_to_back, [0.25] * 40) == 4
    assert metrics.peak_concurrent_requests([0.0, 0.1, 0.2], [1.0, 0.05, 0.5]) == 2  # 0.1-0.15 and 0.2-0.7 in A
    # a token per second over four seconds, two requests: still buckets, 2 at most in any one second
    assert metrics.peak_output_tokens_per_second([0.0, 0.5], [0.1, 0.1], [[1.0, 1.0, 1.0], [1.0]], [3.1, 1.1]) == 2.0
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
    result = _request(monkeypatch, script, prompt_len, **options)
    assert result.ok, result.error
    return result


def _request(monkeypatch, script, prompt_len=None, **options) -> RequestResult:
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

    return asyncio.run(send())


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


EOS_FIRST = [  # the model's first token is EOS: a role chunk, the finish, then the usage
    (1.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    (1.2, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    (1.3, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}),
    (1.4, "[DONE]"),
]


def test_a_vllm_line_counts_an_answer_without_text(monkeypatch):
    """vLLM's request functions succeed once an event had a choice (first_chunk_received), text or not, and take
    usage.completion_tokens as the output tokens: an empty answer (EOS first, common on ShareGPT without
    --ignore-eos) is a timed one-token request, not a failure."""
    res = _send(monkeypatch, EOS_FIRST, vllm_form=True)
    assert (res.ttft_s, res.e2e_s, res.output_tokens, res.prompt_tokens) == (1.0, 1.2, 1, 7)
    assert res.itl_s == [pytest.approx(0.2)]
    lv = serve_bench.summarize_level(1, [res], 2.0)
    assert (lv.ok, lv.failed, lv.output_tokens, lv.input_tokens) == (1, 0, 1, 7)
    # without usage vLLM tokenizes the text streamed, none here: 0 tokens, still a success
    no_usage = [(at, e) for at, e in EOS_FIRST if not (isinstance(e, dict) and "usage" in e)]
    assert _send(monkeypatch, no_usage, vllm_form=True).output_tokens == 0
    # radiance's own line wants text
    assert _request(monkeypatch, EOS_FIRST).error == "no tokens streamed"


def test_a_vllm_line_fails_a_stream_without_any_choice(monkeypatch):
    usage_only = [(1.0, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 0}}), (1.1, "[DONE]")]
    res = _request(monkeypatch, usage_only, vllm_form=True)
    assert not res.ok and "no event with a choice" in res.error


def test_a_vllm_line_counts_a_stream_that_ends_without_a_finish(monkeypatch):
    """vLLM's success is the first choice alone: a body that ends cleanly after text, with no finish_reason or
    [DONE], is a success there (radiance's own line fails it: its numbers would flatter the server)."""
    cut = CHAT_SCRIPT[:3]
    assert _send(monkeypatch, cut, vllm_form=True).e2e_s == 2.5
    assert "without a finish_reason or [DONE]" in _request(monkeypatch, cut).error


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


def test_random_prompts_leave_room_for_the_tokenizer_s_special_tokens():
    """vLLM's RandomDataset makes a prompt of --random-input-len less tokenizer.num_special_tokens_to_add() tokens
    of its own (encoded without special tokens; prompt_len is that count), so that with the BOS the server adds it
    reads --random-input-len. Fitted to the full length without them, a BOS tokenizer's server read one more."""
    def handler(request):  # a word a token, a BOS unless add_special_tokens is false
        body = json.loads(request.content)
        return httpx.Response(200, json={"count": len(body["prompt"].split()) + body.get("add_special_tokens", True)})

    async def fit():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t") as c:
            return await serve_prompts.fit_to_tokens(c, MODEL, serve_prompts.random_prompts(3, 9, 4, 0), 12, 0)

    fitted = asyncio.run(fit())
    assert [len(s.prompt.split()) for s in fitted] == [11] * 3 and [s.prompt_len for s in fitted] == [11] * 3


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
    specs = serve_prompts.load_dataset(str(path), 128, shuffle_seed=seed, vllm=True)
    assert [(s.prompt, s.reply) for s in specs] == _vllm_order(rows, seed)


def test_radiance_s_line_walks_the_file_in_order(tmp_path):
    path, _ = _sharegpt(tmp_path)
    specs = serve_prompts.load_dataset(str(path), 128)
    # the first human turn and the turn after it, in the file's order (the one-turn row has no reply)
    assert [s.prompt for s in specs] == [f"question {i}" for i in range(2)] + ["alone"] + [
        f"question {i}" for i in (3, 4)] + ["a reply"] + [f"question {i}" for i in (6, 7)]


def _record_prompts(monkeypatch) -> list[str]:
    """serve_bench.send_request replaced: each request's prompt recorded, answered ok with one token."""
    sent = []

    async def send_request(client, opts, model, spec):
        sent.append(spec.prompt)
        return RequestResult(ok=True, requested_tokens=spec.output_len, output_tokens=1)

    monkeypatch.setattr(serve_bench, "send_request", send_request)
    return sent


def test_a_vllm_run_sends_the_shuffled_prompts_and_reports_the_peaks(monkeypatch, tmp_path):
    path, rows = _sharegpt(tmp_path)
    sent = _record_prompts(monkeypatch)
    opts = ServeBenchOptions(url="http://x", model=MODEL, concurrency=(4,), num_prompts=4, output_len=2,
                             dataset=str(path), progress=False, warmup=0, seed=3, vllm_form=True)
    result = serve_bench.run_serve_bench(opts)
    assert sent == [prompt for prompt, _ in _vllm_order(rows, 3)[:4]]
    assert {"max_output_tokens_per_s", "max_concurrent_requests"} <= result.keys()


def test_a_vllm_line_with_disable_shuffle_keeps_the_file_s_order(monkeypatch, tmp_path):
    """vLLM's --disable-shuffle: ShareGPTDataset.load_data still drops conversations of fewer than two turns and
    seeds the random module, but does not shuffle; turn 0 stays the prompt whoever speaks it."""
    from radiance.bench.cli import serve_options
    from radiance.cli import build_parser

    path, rows = _sharegpt(tmp_path)
    sent = _record_prompts(monkeypatch)
    opts = serve_options(build_parser().parse_args(
        ["bench", "serve", "--url", "http://x", "--model", MODEL, "--dataset-path", str(path), "--disable-shuffle",
         "--output-len", "2", "--num-prompts", "7", "--max-concurrency", "1", "--seed", "3", "--warmup", "0"]))
    assert opts.vllm_form and opts.disable_shuffle
    serve_bench.run_serve_bench(dataclasses.replace(opts, progress=False))
    assert sent == [r["conversations"][0]["value"] for r in rows if len(r["conversations"]) >= 2]
    assert sent[4] == "the model opens" and "alone" not in sent
    assert serve_prompts.load_dataset(str(path), 2, None, vllm=True) == serve_prompts.load_dataset(
        str(path), 2, None, vllm=True)  # no shuffle: the same order every time


# ------------------------------------------------------------------ ShareGPT sizing (vLLM's ShareGPTDataset.sample)


def _byte_tokenize_client():
    """A server whose /tokenize is the tests' ByteTokenizer: a token a byte, and a BOS with add_special_tokens."""
    from tests.server.fake_engine import ByteTokenizer

    tok = ByteTokenizer()

    def handler(request):
        body = json.loads(request.content)
        return httpx.Response(200, json={"count": len(tok.encode(body["prompt"], body.get("add_special_tokens", True)))})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t"), tok


def _vllm_sharegpt_sample(tok, pool, output_len=None):
    """ShareGPTDataset.sample's arithmetic: `tokenizer(text).input_ids` (special tokens included) and
    is_valid_sequence(prompt_len, output_len, skip_min_output_len_check=output_len given)."""
    out = []
    for spec in pool:
        prompt_len = len(tok.encode(spec.prompt))
        n = len(tok.encode(spec.reply)) if output_len is None else output_len
        if prompt_len < 4 or (output_len is None and n < 4) or prompt_len > 1024 or prompt_len + n > 2048:
            continue
        out.append((spec.prompt, n, prompt_len))
    return out


@pytest.mark.parametrize("output_len", [None, 1000])
def test_sharegpt_counts_prompts_and_replies_with_special_tokens(output_len):
    """vLLM counts a ShareGPT prompt and reply as `tokenizer(text).input_ids`, a BOS included: a 3-byte prompt is 4
    tokens (kept), a 4-byte reply asks for 5, the client's prompt_len (its input tokens without usage) is 11 for a
    10-byte prompt, a 1024-byte prompt is over 1024 and 1000 + 1047 bytes over 2048. Counted without special
    tokens, each was one short and the filter kept another set."""
    pool = [PromptSpec("abc", 1, reply="a reply"), PromptSpec("what is up", 1, reply="fine"),
            PromptSpec("ab", 1, reply="a long enough reply"), PromptSpec("x" * 1024, 1, reply="four"),
            PromptSpec("y" * 1000, 1, reply="z" * 1047)]

    async def lengths():
        client, tok = _byte_tokenize_client()
        async with client:
            fixed = {} if output_len is None else {"output_len": output_len}
            return tok, await serve_prompts.sharegpt_lengths(client, MODEL, pool, 10, **fixed)

    tok, got = asyncio.run(lengths())
    got = [(s.prompt, s.output_len, s.prompt_len) for s in got]
    assert got == _vllm_sharegpt_sample(tok, pool, output_len)
    if output_len is None:
        assert got == [("abc", 8, 4), ("what is up", 5, 11)]
    else:  # no reply counted, none checked: 1001 + 1000 fits in 2048
        assert got == [("abc", 1000, 4), ("what is up", 1000, 11), ("y" * 1000, 1000, 1001)]


def test_sharegpt_output_len_still_applies_vllm_s_length_filter(monkeypatch, tmp_path):
    """`--sharegpt-output-len N`: every request asks for N tokens, and vLLM still drops a prompt under 4 tokens or
    over 1024, or over 2048 with N (is_valid_sequence with skip_min_output_len_check: a short reply is fine). The
    filter ran only when the replies sized the requests: a 1-word and a 5000-word prompt were sent."""
    from radiance.bench.cli import serve_options
    from radiance.cli import build_parser

    rows = [_conv(("human", "hi"), ("gpt", "hello there friend")),  # 2-token prompt (a BOS and "hi"): dropped
            _conv(("human", "word " * 5000), ("gpt", "ok ok ok ok")),  # over 1024: dropped
            _conv(("human", "w " * 1000), ("gpt", "fine")),  # 1001 tokens: 1001 + 1100 > 2048, dropped
            _conv(("human", "a question of six words"), ("gpt", "ok"))]  # a 2-token reply: kept
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))

    async def count_tokens(client, model, text, special_tokens=False):  # a word a token, a BOS with special tokens
        return len(text.split()) + special_tokens

    monkeypatch.setattr(serve_prompts, "count_tokens", count_tokens)
    sent = []

    async def send_request(client, opts, model, spec):
        sent.append((spec.prompt, spec.output_len))
        return RequestResult(ok=True, requested_tokens=spec.output_len, output_tokens=1)

    monkeypatch.setattr(serve_bench, "send_request", send_request)
    for flag in ("--sharegpt-output-len", "--output-len"):  # vLLM maps its general --output-len onto the first
        opts = serve_options(build_parser().parse_args(
            ["bench", "serve", "--url", "http://x", "--model", MODEL, "--dataset-name", "sharegpt", "--dataset-path",
             str(path), flag, "1100", "--num-prompts", "2", "--max-concurrency", "1", "--warmup", "0"]))
        assert opts.output_len == 1100 and not opts.output_len_from_dataset
        sent.clear()
        serve_bench.run_serve_bench(dataclasses.replace(opts, progress=False))
        assert sent == [("a question of six words", 1100)] * 2  # the one conversation vLLM keeps, twice
        assert opts.sharegpt_filter


def test_one_token_answers_report_a_tpot_of_zero_as_vllm_does():
    """vLLM leaves one-token answers out of TPOT and reports 0 when none is left (`np.mean(tpots or 0)`), not NaN;
    a level whose requests all failed has no TPOT at all."""
    one = RequestResult(ok=True, start_s=0.0, ttft_s=0.1, e2e_s=0.1, output_tokens=1, requested_tokens=1)
    v = serve_bench.vllm_metrics(serve_bench.summarize_level(1, [one, one], 1.0).as_dict())
    assert v["mean_tpot_ms"] == 0.0 and v["p99_tpot_ms"] == 0.0
    assert "Mean TPOT (ms):                          0.00" in serve_bench.vllm_summary(v, ("tpot",), (99.0,))
    failed = serve_bench.summarize_level(1, [RequestResult(ok=False, error="HTTP 500", start_s=0.0)], 1.0).as_dict()
    assert math.isnan(serve_bench.vllm_metrics(failed)["mean_tpot_ms"])
