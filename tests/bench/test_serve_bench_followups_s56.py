"""`radiance bench serve` against vLLM's `vllm bench serve` (vllm/benchmarks/serve.py, datasets, lib/): streamed
errors, output tokens without usage, short datasets, the warm-up and a --random-input-len within the special tokens.
The server is scripted on httpx.MockTransport: a word in the prompt picks its behaviour."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import pytest

from radiance.bench import report, serve_bench, serve_prompts
from radiance.bench import serve_server as serve_bench_server
from radiance.bench.serve_bench import ServeBenchOptions
from radiance.bench.serve_stream import Stream
from radiance.errors import ConfigError

MODEL = "m"


def _event(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class Server:
    """Two text chunks of two words each ("a b", " c d"); its /tokenize counts words (+`specials` with
    add_special_tokens). Prompt words: ERRMID (an error event after the first chunk), OLDERR (old vLLM's
    `{"object": "error"}` event), NULLERR (`"error": null` beside the choices), ERR500 (HTTP 500), NOUSAGE."""

    def __init__(self, specials: int = 1, tokenize: bool = True, fail_first: int = 0, loading: int = 0):
        self.specials, self.tokenize, self.fail_first = specials, tokenize, fail_first
        self.loading = loading  # /health answers 503 (and /tokenize too) until asked this many times
        self.prompts: list[str] = []
        self.in_flight = self.max_in_flight = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            self.loading -= self.loading > 0
            return httpx.Response(503 if self.loading > 0 else 200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        if request.url.path == "/tokenize" and self.loading > 0:
            return httpx.Response(503, json={"error": {"message": "the model is still loading"}})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            if not self.tokenize:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"count": len(body["prompt"].split()) + (
                self.specials if body.get("add_special_tokens") else 0)})
        prompt = body["prompt"]
        self.prompts.append(prompt)
        if "ERR500" in prompt or len(self.prompts) <= self.fail_first:
            return httpx.Response(500, json={"error": {"message": "engine died", "code": 500}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.events(prompt))

    async def events(self, prompt: str):
        self.in_flight += 1  # until its [DONE]: the client stops reading there
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        yield _event({"choices": [{"index": 0, "text": "a b"}], **({"error": None} if "NULLERR" in prompt else {})})
        if "ERRMID" in prompt:
            yield _event({"error": {"message": "out of KV cache", "type": "InternalServerError", "code": 500}})
        if "OLDERR" in prompt:
            yield _event({"object": "error", "message": "bad request", "type": "BadRequestError", "code": 400})
        yield _event({"choices": [{"index": 0, "text": " c d", "finish_reason": "length"}]})
        if "NOUSAGE" not in prompt:
            yield _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
        self.in_flight -= 1
        yield _event("[DONE]")


@pytest.fixture
def serve(monkeypatch, tmp_path):
    """Runs `radiance bench serve` against a Server: serve(server, prompts or None, **options) -> result."""
    original = httpx.AsyncClient

    def run(server: Server, prompts: list[str] | None = None, **options):
        class Client(original):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "transport": httpx.MockTransport(server.handler)})
        monkeypatch.setattr(serve_bench.httpx, "AsyncClient", Client)
        if prompts is not None:
            data = tmp_path / "prompts.txt"
            data.write_text("\n".join(prompts) + "\n")
            options = {"dataset": str(data), "num_prompts": len(prompts), **options}
        base = dict(url="http://x", model=MODEL, concurrency=(2,), num_prompts=2, output_len=4, progress=False,
                    warmup=0)
        return serve_bench.run_serve_bench(ServeBenchOptions(**{**base, **options}))
    return run


# ------------------------------------------------------------------ 1. streamed errors


@pytest.mark.parametrize("vllm_form", [False, True])
def test_streamed_and_http_errors_fail_their_request_with_the_server_s_message(serve, vllm_form):
    """An error event mid-stream (vLLM's and SGLang's `{"error": {...}}`, old vLLM's `{"object": "error"}`) or an
    HTTP 500 fails its request with the message, not a dict's repr; `"error": null` beside a choice is no error
    (it failed its request). vLLM itself would count a mid-stream error after a choice as a success."""
    result = serve(Server(), ["ok", "ERRMID", "OLDERR", "NULLERR", "ERR500"], concurrency=(5,), vllm_form=vllm_form)
    level = result["levels"][0]
    assert (level["ok"], level["failed"]) == (2, 3)
    assert sorted(level["errors"]) == ["HTTP 500: engine died (code 500)",
                                       "stream error: bad request (type BadRequestError, code 400)",
                                       "stream error: out of KV cache (type InternalServerError, code 500)"]


# ------------------------------------------------------------------ 2. output tokens without usage


@pytest.mark.parametrize("vllm_form", [False, True])
def test_without_usage_the_text_is_tokenized_as_vllm_counts_it_and_the_report_says_so(serve, vllm_form):
    """vLLM's calculate_metrics tokenizes the generated text when no usage came: "a b c d" is 4 tokens (the server's
    /tokenize counts words here), not the 2 chunks it came in; TPOT divides by 3 such tokens."""
    result = serve(Server(), ["NOUSAGE one", "NOUSAGE two"], vllm_form=vllm_form)
    level = result["levels"][0]
    assert level["output_tokens"] == 8 and level["counted_from_chunks"] == 0
    assert (level["counted_from_text"], level["text_tokens"], level["text_chunks"]) == (2, 8, 4)
    assert level["short_outputs"] == 0  # a retokenized text cannot tell a short answer
    notes = report._level_notes(level, True)
    assert any("2 of 2 requests came without usage: their 8 output tokens are their text's by the server's "
               "/tokenize" in n and "counted as streamed chunks they were 4" in n for n in notes), notes
    if vllm_form:
        assert result["total_output_tokens"] == 8
    else:  # radiance's timing spreads the 4 tokens over the 2 chunks: the second chunk's 2 tokens are 2 gaps
        assert level["itl_ms"]["mean"] * 2 == pytest.approx(level["e2e_s"]["mean"] * 1e3 - level["ttft_ms"]["mean"],
                                                            rel=0.2)


def test_vllm_s_line_takes_the_tokenized_count_even_below_the_chunks(serve, monkeypatch):
    """vLLM uses the tokenizer's count as it is; radiance's lines keep at least one token a text chunk."""
    counts = {}
    for vllm_form in (False, True):
        server = Server()
        original = server.handler

        async def one_token_texts(request, original=original):  # "a b c d" tokenizes to 1
            if request.url.path == "/tokenize" and not json.loads(request.content).get("add_special_tokens"):
                return httpx.Response(200, json={"count": 1})
            return await original(request)
        server.handler = one_token_texts
        counts[vllm_form] = serve(server, ["NOUSAGE x"], concurrency=(1,), vllm_form=vllm_form)["levels"][0][
            "output_tokens"]
    assert counts == {False: 2, True: 1}


def test_a_server_without_tokenize_keeps_the_chunk_count_and_says_so(serve, caplog):
    with caplog.at_level(logging.WARNING):
        level = serve(Server(tokenize=False), ["NOUSAGE one"], concurrency=(1,))["levels"][0]
    assert level["output_tokens"] == 2 and level["counted_from_chunks"] == 1 and level["counted_from_text"] == 0
    assert "/tokenize did not count the text" in caplog.text


# ------------------------------------------------------------------ 3. a dataset shorter than --num-prompts


def test_a_vllm_line_oversamples_a_short_dataset_as_vllm_does(serve, caplog):
    """vLLM's maybe_oversample_requests: the (shuffled) rows, then random.seed(seed); random.choice(rows) for each
    request more, with its log line. It cycled the rows before."""
    server = Server()
    with caplog.at_level(logging.INFO):
        serve(server, ["p0", "p1", "p2"], num_prompts=8, concurrency=(8,), vllm_form=True, seed=5)
    rows = ["p0", "p1", "p2"]
    random.seed(5)
    random.shuffle(rows)
    random.seed(5)
    assert server.prompts == rows + [random.choice(rows) for _ in range(5)]
    assert "Oversampled requests to reach 8 total samples." in caplog.text


def test_radiance_s_line_still_cycles_a_short_dataset(serve):
    server = Server()
    serve(server, ["p0", "p1", "p2"], num_prompts=7, concurrency=(1,))
    assert server.prompts == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]


# ------------------------------------------------------------------ 4. the warm-up


def test_a_vllm_line_warms_up_with_copies_of_its_first_request_unchecked(serve):
    """vLLM's --num-warmups: copies of the run's first request at once, at most --max-concurrency in flight, their
    failures not checked; no test request (vLLM's --ready-check-timeout-sec 0 default)."""
    server = Server(fail_first=1)
    result = serve(server, ["p0", "p1", "p2", "p3"], num_prompts=4, concurrency=(2,), warmup=3, vllm_form=True,
                   disable_shuffle=True)
    assert server.prompts == ["p0"] * 3 + ["p0", "p1", "p2", "p3"]
    assert server.max_in_flight == 2 and result["completed"] == 4


def test_radiance_s_line_still_stops_at_a_failed_warmup(serve):
    with pytest.raises(ConfigError, match="warmup request failed: HTTP 500: engine died"):
        serve(Server(fail_first=1), ["p0"], warmup=1)


def test_vllm_s_ready_check_retries_the_first_request_until_it_succeeds(serve, monkeypatch):
    monkeypatch.setattr(serve_bench, "READY_RETRY_S", 0.01)
    server = Server(fail_first=2)
    serve(server, ["p0", "p1"], vllm_form=True, disable_shuffle=True, ready_check_s=5.0)
    assert server.prompts == ["p0"] * 3 + ["p0", "p1"]
    with pytest.raises(ConfigError, match="Initial test run failed .*Error: HTTP 500: engine died"):
        serve(Server(fail_first=100), ["p0"], vllm_form=True, ready_check_s=0.05)


def test_the_ready_check_waits_for_a_loading_server_before_its_tokenize_counts(serve, monkeypatch):
    """The review's case: the special tokens were counted (/tokenize: 503 while loading) before the ready check
    waited, so the prompts went out unfitted (33 tokens for 32 asked)."""
    monkeypatch.setattr(serve_bench_server, "READY_RETRY_S", 0.01)
    server = Server(specials=1, loading=2)
    serve(server, None, input_len=4, exact_input_len=True, vllm_form=True, ready_check_s=5.0)
    assert server.prompts and {len(p.split()) for p in server.prompts} == {3}  # + the BOS: the 4 tokens asked for
    with pytest.raises(ConfigError, match="not ready within --ready-check-timeout-sec 0.05 .*HTTP 503"):
        serve(Server(loading=100), None, input_len=4, exact_input_len=True, vllm_form=True, ready_check_s=0.05)


def test_radiance_s_line_takes_the_ready_check_too(serve, monkeypatch):
    """--ready-check-timeout-sec was read by a vLLM line's warm-up only: radiance's stopped at the first 503."""
    monkeypatch.setattr(serve_bench, "READY_RETRY_S", 0.01)
    server = Server(fail_first=2)
    serve(server, ["p0", "p1"], warmup=1, ready_check_s=5.0)
    assert len(server.prompts) == 3 + 1 + 2  # two failed test requests, the one that answered, the warm-up, the run


def test_an_unreachable_tokenize_is_a_one_line_error():
    async def count():
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as client:
            return await serve_prompts.count_tokens(client, MODEL, "a b")
    with pytest.raises(ConfigError, match="could not reach the server's /tokenize .*check --url"):
        asyncio.run(count())


def test_the_text_counted_without_usage_is_the_content_alone():
    """vLLM's generated_text holds the content: servers send reasoning under both its names, so joined it counted
    twice."""
    stream = Stream()
    stream.add({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm", "reasoning": "hmm"}}]}, 1.0)
    stream.add({"choices": [{"index": 0, "delta": {"content": "Paris."}}]}, 2.0)
    assert "".join(stream.text) == "Paris." and len(stream.chunk_times) == 2


# ------------------------------------------------------------------ 5. --random-input-len within the special tokens


def test_a_random_input_len_the_special_tokens_fill_is_refused_before_any_request(serve):
    """vLLM's RandomDataset raises for it; radiance sent one-word prompts (2 tokens with the BOS, for 1 asked)."""
    server = Server(specials=1)
    with pytest.raises(ConfigError, match="--random-input-len 1 is too small: the server's tokenizer adds 1 special"):
        serve(server, None, input_len=1, exact_input_len=True, vllm_form=True)
    assert server.prompts == []
    server = Server(specials=1)
    serve(server, None, input_len=2, exact_input_len=True, vllm_form=True)
    assert {len(p.split()) for p in server.prompts} == {1}  # + the BOS: the 2 tokens asked for


# ------------------------------------------------------------------ vLLM's result file: its keys and values


def _done(ttft: float, e2e: float, tokens: int) -> serve_bench.RequestResult:
    return serve_bench.RequestResult(ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, requested_tokens=tokens)


def test_request_goodput_counts_requests_within_every_objective_as_vllm_does():
    """vLLM's calculate_metrics: TTFT, TPOT (0 for a one-token answer) and E2EL each at most its objective (ms)."""
    results = [_done(0.05, 0.50, 11),   # TPOT 45 ms: good
               _done(0.05, 0.90, 11),   # TPOT 85 ms: over the 50 ms TPOT
               _done(0.20, 0.30, 2),    # TTFT 200 ms: over the 100 ms TTFT
               _done(0.08, 0.08, 1),    # one token: TPOT 0, good
               serve_bench.RequestResult(ok=False, error="HTTP 500")]
    slos = (("ttft", 100.0), ("tpot", 50.0), ("e2el", 1000.0))
    level = serve_bench.summarize_level(5, results, 2.0, goodput=slos).as_dict()
    assert level["request_goodput"] == pytest.approx(2 / 2.0)
    keys = serve_bench.vllm_metrics(level)
    assert keys["request_goodput"] == pytest.approx(1.0)
    assert "Request goodput (req/s):                 1.00" in serve_bench.vllm_summary(keys, ("ttft",), (99.0,))
    plain = serve_bench.vllm_metrics(serve_bench.summarize_level(5, results, 2.0).as_dict())
    assert "request_goodput" in plain and plain["request_goodput"] is None  # vLLM's null without --goodput
    assert "goodput" not in serve_bench.vllm_summary(plain, ("ttft",), (99.0,))


@pytest.mark.parametrize("goodput", [(("ttft", -1.0),), (("queue", 5.0),)])
def test_goodput_objectives_are_checked(goodput):
    with pytest.raises(ConfigError, match="goodput objectives are ttft, tpot or e2el"):
        ServeBenchOptions(goodput=goodput)


def test_parse_goodput_reads_vllm_s_pairs():
    from radiance.bench.vllm_serve_args import parse_goodput

    assert parse_goodput(["ttft:100", "e2el:2500.5"]) == (("ttft", 100.0), ("e2el", 2500.5))
    assert parse_goodput(None) == ()
    with pytest.raises(ConfigError, match="KEY:MILLISECONDS"):
        parse_goodput(["ttft=100"])


def test_a_one_level_result_carries_vllm_s_run_keys_and_a_null_unlimited_concurrency(serve):
    result = serve(Server(), ["p0", "p1"], vllm_form=True, unlimited=True, endpoint="completions")
    assert {k: result[k] for k in ("backend", "endpoint_type", "label", "tokenizer_id", "burstiness",
                                   "request_goodput", "max_concurrency")} == {
        "backend": "openai", "endpoint_type": "openai", "label": None, "tokenizer_id": MODEL, "burstiness": 1.0,
        "request_goodput": None, "max_concurrency": None}
    assert len(result["date"]) == len("20250101-120000")
    block = serve_bench.serve_table(result)
    assert "Maximum request concurrency" not in block  # vLLM prints it only for a --max-concurrency
    limited = serve(Server(), ["p0", "p1"], vllm_form=True)
    assert limited["max_concurrency"] == 2 and "Maximum request concurrency:" in serve_bench.serve_table(limited)


def test_vllm_s_warmup_ready_check_goodput_and_percentile_defaults_reach_the_options():
    from radiance.bench.cli import serve_options
    from radiance.cli import build_parser

    def options(*argv):
        return serve_options(build_parser().parse_args(["bench", "serve", *argv]))

    vllm = options("--max-concurrency", "2", "--ready-check-timeout-sec", "600", "--goodput", "ttft:100", "e2el:900")
    assert (vllm.warmup, vllm.ready_check_s, vllm.goodput) == (0, 600, (("ttft", 100.0), ("e2el", 900.0)))
    assert (vllm.percentile_metrics, vllm.metric_percentiles, vllm.unlimited) == (("ttft", "tpot", "itl"), (99.0,), False)
    assert options("--num-prompts", "4", "--num-warmups", "3").warmup == 3
    assert options("--base-url", "http://x").unlimited
    ours = options("--url", "http://x")
    assert (ours.warmup, ours.metric_percentiles, ours.unlimited) == (1, (50.0, 99.0), False)
