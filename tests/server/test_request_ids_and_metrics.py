"""Response ids from the client's X-Request-Id (as vLLM derives them), engine request ids that stay unique, every
engine request ending once in /metrics (finished, aborted or failed), OpenAI's 404 shapes, and a compressed body's
415."""

import asyncio
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from radiance.config import ConfigError, ServerConfig
from radiance.engine.outputs import EngineStats, HistogramCounts, RequestTimes, StepHistogram
from radiance.server.api import build_app
from radiance.server.metrics import RequestTimer, ServerMetrics
from radiance.server.serving_common import EngineJob, merged_outputs
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, free_port, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http

SLOW = "SAY:SLOW" + "z" * 200  # 10 s of tokens: still running when the test ends it
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


class RefusingEngine(FakeEngine):
    """Refuses a prompt holding REFUSE up front (ValueError before any output), as the real engine refuses
    a request it cannot take."""

    async def generate(self, request_id, prompt_token_ids, params):
        if b"REFUSE" in bytes(t for t in prompt_token_ids if t < 256):
            raise ValueError("scripted refusal")
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out


@pytest.fixture(scope="module")
def server():
    engine = RefusingEngine()
    with serve_engine(engine, max_n=4) as url:
        yield url, engine


def chat_body(say: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": "SAY:" + say}], **kw}


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ------------------------------------------------------------------ body ids from X-Request-Id

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,prefix", [(CHAT, chat_body("hi"), "chatcmpl-"),
                                              (COMPLETIONS, {"prompt": "SAY:hi"}, "cmpl-")])
def test_the_body_id_is_the_clients_x_request_id_with_vllms_prefix(server, path, body, prefix, stream):
    r = httpx.post(server[0] + path, json={**body, "stream": stream}, headers={"X-Request-Id": "trace-7"},
                   timeout=30)
    ids = {chunk["id"] for chunk in sse_data(r.text)} if stream else {r.json()["id"]}
    assert ids == {prefix + "trace-7"}


@pytest.mark.parametrize("path,body,prefix", [(CHAT, chat_body("hi"), "chatcmpl-"),
                                              (COMPLETIONS, {"prompt": "SAY:hi"}, "cmpl-")])
def test_without_the_header_ids_are_new_each_time_and_the_header_names_the_body(server, path, body, prefix):
    """The X-Request-Id the server makes (sent back, tagging the log lines) is the body id's own, so a client can
    find its answer in the log (they were two unrelated random ids)."""
    answers = [httpx.post(server[0] + path, json=body, timeout=30) for _ in range(2)]
    ids = [r.json()["id"] for r in answers]
    assert all(re.fullmatch(re.escape(prefix) + "[0-9a-f]{32}", i) for i in ids), ids
    assert ids[0] != ids[1]
    assert [prefix + r.headers["x-request-id"] for r in answers] == ids


@pytest.mark.parametrize("header", [b"x" * 129, "../weird-id/\u00fc".encode(), b"two words"])
def test_an_id_that_is_not_plain_visible_ascii_is_replaced_by_a_new_one(server, header):
    """A 129-character, a non-ASCII (mojibake once read as latin-1) or a spaced X-Request-Id would end up in the
    body id and the log lines: the server makes its own id instead and sends that one back."""
    r = httpx.post(server[0] + CHAT, json=chat_body("hi"), headers={"X-Request-Id": header}, timeout=30)
    assert r.status_code == 200
    assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"]) and r.json()["id"] == "chatcmpl-" + r.headers[
        "x-request-id"]
    longest = "a:b/c" + "9" * 123  # 128 visible ASCII characters: kept as sent
    assert httpx.post(server[0] + CHAT, json=chat_body("hi"), headers={"X-Request-Id": longest},
                      timeout=30).json()["id"] == "chatcmpl-" + longest


def test_a_compressed_body_gets_a_415_that_says_so_and_the_server_goes_on(server):
    import gzip

    body = json.dumps(chat_body("hi")).encode()
    r = httpx.post(server[0] + CHAT, content=gzip.compress(body), timeout=30,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    check_error_shape(r, 415, None)
    assert "Content-Encoding gzip is not supported" in r.json()["error"]["message"]
    plain = httpx.post(server[0] + CHAT, content=body, timeout=30,
                       headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == "hi"


def test_engine_request_ids_carry_the_body_id_and_stay_unique(server):
    """Two requests at once with the same X-Request-Id (a retry, a proxy's fixed id): the engine (which refuses
    an id in use) gets distinct ids, each `<body id>-<choice>-<random>` as vLLM's engine suffixes them."""
    url, engine = server
    seen = len(engine.requests)

    async def send(client):
        return await client.post(CHAT, json=chat_body("same id", n=2), headers={"X-Request-Id": "dup"})

    async def both():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(send(client), send(client))

    answers = asyncio.run(both())
    assert [[c["message"]["content"] for c in a.json()["choices"]] for a in answers] == [["same id"] * 2] * 2
    ids = [request_id for request_id, *_ in engine.requests[seen:]]
    assert len(ids) == 4 and len(set(ids)) == 4, ids
    assert all(re.fullmatch(r"chatcmpl-dup-[01]-[0-9a-f]{8}", i) for i in ids), ids


def test_a_responses_id_stays_its_own_with_the_header(server):
    """vLLM's /v1/responses ids come from the body's request_id (resp_<random> by default), never from the
    header; here a response id is also a stored response's key, so two requests sharing a header must not
    share an id."""
    url = server[0]
    ids = [httpx.post(url + RESPONSES, json={"input": f"SAY:r{k}"}, headers={"X-Request-Id": "trace-r"},
                      timeout=30).json()["id"] for k in range(2)]
    assert all(re.fullmatch(r"resp_[0-9a-f]{24}", i) for i in ids) and ids[0] != ids[1], ids
    assert [httpx.get(f"{url}{RESPONSES}/{i}", timeout=30).json()["output"][0]["content"][0]["text"]
            for i in ids] == ["r0", "r1"]


# ------------------------------------------------------------------ every engine request ends once in /metrics

def scrape(url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            samples[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return samples


E2E = "radiance_e2e_request_latency_seconds_count"


def ended(url: str, before: dict[str, float]) -> dict[str, float]:
    """How many engine requests ended since `before`, by finish reason, and the e2e histogram's growth."""
    after = scrape(url)
    grew = {name[len("radiance_request_success_total["):-1]: after[name] - before.get(name, 0.0)
            for name in after if name.startswith("radiance_request_success_total[")}
    return {**{k: v for k, v in grew.items() if v}, "e2e": after[E2E] - before.get(E2E, 0.0)}


def wait_for(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_reason_labels_show_from_the_start():
    metrics = ServerMetrics(lambda: None, lambda: "m").render().decode()
    for reason in ("stop", "length", "abort", "error"):
        assert f'radiance_request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in metrics


def test_every_series_names_the_model_and_none_is_a_created_timestamp():
    """vLLM's model_name label on every series (the histograms and request counters had none), read when
    recorded (the served name can change once the model loads), and no `*_created` series (vLLM turns them off)."""
    name = ["before-load"]
    metrics = ServerMetrics(lambda: SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.5,
                                                    num_preemptions=0, prompt_tokens_total=3,
                                                    generation_tokens_total=4, draft_tokens_total=0,
                                                    accepted_draft_tokens_total=0, prefix_cache_queries_total=8,
                                                    prefix_cache_hits_total=4), lambda: name[0])
    name[0] = "smol"
    timer = RequestTimer(metrics)
    timer.tokens(1)
    timer.tokens(3)
    timer.finished("stop")
    metrics.http_error(400)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("model_name") == "smol" for s in samples), samples
    assert not [s.name for s in samples if s.name.endswith("_created")]
    value = {(s.name, s.labels.get("finished_reason"), s.labels.get("status")): s.value for s in samples}
    assert value["radiance_request_success_total", "stop", None] == 1
    assert value["radiance_request_errors_total", None, "400"] == 1
    assert value["radiance_time_to_first_token_seconds_count", None, None] == 1
    assert value["radiance_time_per_output_token_seconds_count", None, None] == 1


def _values(metrics: ServerMetrics) -> dict[tuple, float]:
    """(sample name, its labels but model_name, sorted) -> value."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_request_phases_and_sizes_come_from_the_engines_times():
    """vLLM's phases: queue (arrival to first scheduling), prefill (to the first token), decode (to the last),
    inference (first scheduling to last token), from the times on the engine's latest output; a request that
    never reached a token has no phases, but its sizes count as its e2e does."""
    metrics = ServerMetrics(lambda: None, lambda: "m", max_model_len=lambda: 100)
    timer = RequestTimer(metrics, arrival=10.0, num_prompt_tokens=7, max_tokens=20)
    timer.tokens(1, RequestTimes(first_scheduled=11.0, first_token=13.5, last_token=13.5))
    timer.tokens(4, RequestTimes(first_scheduled=11.0, first_token=13.5, last_token=17.25))
    timer.finished("length")
    RequestTimer(metrics, num_prompt_tokens=3, max_tokens=5).finished("abort")  # gone before its first token
    refused = RequestTimer(metrics, num_prompt_tokens=3)
    refused.discard()
    refused.finished("abort")
    value = _values(metrics)
    for name, seconds in (("queue", 1.0), ("prefill", 2.5), ("decode", 3.75), ("inference", 6.25)):
        assert value[f"radiance_request_{name}_time_seconds_sum", ()] == seconds
        assert value[f"radiance_request_{name}_time_seconds_count", ()] == 1
    assert value["radiance_request_prompt_tokens_sum", ()] == 10
    assert value["radiance_request_prompt_tokens_count", ()] == 2
    assert value["radiance_request_generation_tokens_sum", ()] == 4
    assert value["radiance_request_params_max_tokens_sum", ()] == 25
    les = [dict(labels)["le"] for name, labels in value if name == "radiance_request_prompt_tokens_bucket"]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]  # 1-2-5 up to max_model_len


def test_the_engines_step_histograms_and_cache_info_render_as_vllms():
    steps = StepHistogram((1, 8))
    for tokens in (1, 1, 8, 9, 30):  # a value on a bound is in its bucket (le)
        steps.observe(tokens)
    assert steps.snapshot() == HistogramCounts((1, 8), (2, 1, 2), 49.0)
    stats = EngineStats(1, 0, 0.5, 0, 3, 4, iteration_tokens=steps.snapshot(),
                        inter_token_latency=HistogramCounts((0.01, 0.1), (0, 3, 1), 0.5),
                        cache_config={"block_size": "16", "num_gpu_blocks": "99"})
    value = _values(ServerMetrics(lambda: stats, lambda: "m", "vllm:"))
    assert [value["vllm:iteration_tokens_total_bucket", (("le", le),)] for le in ("1.0", "8.0", "+Inf")] == [2, 3, 5]
    assert value["vllm:iteration_tokens_total_count", ()] == 5 and value["vllm:iteration_tokens_total_sum", ()] == 49
    assert [value["vllm:inter_token_latency_seconds_bucket", (("le", le),)] for le in ("0.01", "0.1", "+Inf")] == [
        0, 3, 4]
    assert value["vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "99"))] == 1


def test_each_prompt_counts_its_n_and_longest_choice_once(server):
    """vLLM's request_params_n and request_max_num_generation_tokens: once per prompt (a completion's prompt
    list has several), once all its choices ended; none for a request the engine refused."""
    url = server[0]
    before = scrape(url)
    httpx.post(url + CHAT, json=chat_body("done", n=2), timeout=30)
    httpx.post(url + COMPLETIONS, json={"prompt": ["SAY:abc", "SAY:abcdefg"], "n": 2, "max_tokens": 5}, timeout=30)
    httpx.post(url + CHAT, json=chat_body("REFUSE", n=2), timeout=30)
    after = scrape(url)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["radiance_request_params_n_count"] == 3 and grew["radiance_request_params_n_sum"] == 6
    # each prompt's longest choice: "done", "abc", "abcde" (max_tokens 5), a byte a token
    assert grew["radiance_request_max_num_generation_tokens_sum"] == 4 + 3 + 5
    assert grew["radiance_request_generation_tokens_count"] == 6
    assert grew["radiance_request_generation_tokens_sum"] == 2 * (4 + 3 + 5)


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_request_counts_once_with_its_reason(server, stream):
    url = server[0]
    before = scrape(url)
    httpx.post(url + CHAT, json=chat_body("done", n=2, stream=stream), timeout=30)
    httpx.post(url + COMPLETIONS, json={"prompt": "SAY:cut short", "max_tokens": 3, "stream": stream}, timeout=30)
    assert ended(url, before) == {"stop": 2, "length": 1, "e2e": 3}


def hang_up_mid_way(url: str, engine: FakeEngine, path: str, body: dict, choices: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    try:
        assert wait_for(lambda: len(engine.active) == choices), engine.active
        time.sleep(0.2)  # a few tokens out: the abort comes mid-way
    finally:
        sock.close()
    assert wait_for(lambda: not engine.active), engine.active


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [(CHAT, chat_body(SLOW[4:], n=2)), (COMPLETIONS, {"prompt": SLOW, "n": 2}),
                                       (RESPONSES, {"input": SLOW})])
def test_a_client_that_leaves_ends_its_requests_as_aborted(server, path, body, stream):
    url, engine = server
    before = scrape(url)
    choices = body.get("n", 1)
    hang_up_mid_way(url, engine, path, {**body, "stream": stream}, choices)
    assert wait_for(lambda: ended(url, before) == {"abort": choices, "e2e": choices}), ended(url, before)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [(CHAT, chat_body("abcFAILxyz", n=2)),
                                       (COMPLETIONS, {"prompt": "SAY:abcFAILxyz"}),
                                       (RESPONSES, {"input": "SAY:abcFAILxyz"})])
def test_an_engine_failure_mid_way_ends_as_error(server, path, body, stream):
    """The failing choice ends as `error` (vLLM's reason for a request the engine failed, answered 500); a
    sibling choice still running when the request fails is aborted with it."""
    url = server[0]
    before = scrape(url)
    r = httpx.post(url + path, json={**body, "stream": stream}, timeout=30)
    assert r.status_code == (200 if stream else 500)
    got = ended(url, before)
    n = body.get("n", 1)
    assert got["e2e"] == n and got.get("error", 0) >= 1 and got.get("error", 0) + got.get("abort", 0) == n, got


def test_a_request_the_engine_refuses_is_no_engine_request(server):
    """Refused before it started (a 400): it never ran, as vLLM counts no request its input checks refuse."""
    url = server[0]
    before = scrape(url)
    r = httpx.post(url + CHAT, json=chat_body("REFUSE"), timeout=30)
    check_error_shape(r, 400, None)
    assert ended(url, before) == {"e2e": 0}


def test_requests_cut_by_the_server_stopping_end_as_aborted():
    """uvicorn cancels what still runs after its graceful timeout: those requests end as `abort`."""
    engine = FakeEngine()
    state = ServerState(ServerConfig(served_model_name=("fake",)), engine_factory=lambda: engine)
    state.attach(engine)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=free_port(),
                                           log_level="warning", timeout_graceful_shutdown=0.3))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    url = f"http://127.0.0.1:{server.config.port}"
    bodies = [chat_body(SLOW[4:]), chat_body(SLOW[4:], stream=True), {"input": SLOW, "stream": True}]
    clients = [threading.Thread(target=lambda p=path, b=body: _post_quietly(url + p, b))
               for path, body in zip((CHAT, CHAT, RESPONSES), bodies)]
    for client in clients:
        client.start()
    assert wait_for(lambda: len(engine.active) == 3), engine.active
    server.should_exit = True
    thread.join(timeout=20)
    for client in clients:
        client.join(timeout=20)
    samples = {s.name + str(s.labels.get("finished_reason", "")): s.value
               for f in text_string_to_metric_families(state.metrics.render().decode()) for s in f.samples}
    assert samples["radiance_request_success_totalabort"] == 3 and samples[E2E] == 3, samples


def _post_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(url, json=body, timeout=30)
    except httpx.HTTPError:
        pass


def cancel_consumer_midway(engine, jobs: list[EngineJob], metrics: ServerMetrics) -> None:
    """merged_outputs' consumer cancelled 0.2 s in (the server stopping), then the generator closed."""
    async def run():
        outputs = merged_outputs(engine, jobs, metrics)

        async def consume():
            async for _ in outputs:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await outputs.aclose()

    asyncio.run(run())


def test_merged_outputs_cancelled_mid_way_records_each_job_once():
    """The consumer cancelled while it waits (the server stopping): each unfinished job ends once as abort,
    and closing the generator again records nothing more."""
    engine = FakeEngine()
    metrics = ServerMetrics(lambda: None, lambda: "m")
    prompt = engine.tokenizer.encode(SLOW)
    jobs = [EngineJob(f"job-{i}", prompt, _params()) for i in range(2)]

    cancel_consumer_midway(engine, jobs, metrics)
    sample = metrics.registry.get_sample_value
    assert sample("radiance_request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 2
    assert sample(E2E, {"model_name": "m"}) == 2 and sorted(engine.aborted) == ["job-0", "job-1"]


def _params():
    from radiance.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=500)


# ------------------------------------------------------------------ 404s in OpenAI's shape

@pytest.mark.parametrize("method,path,body", [("POST", CHAT, {**chat_body("x"), "model": "gpt-x"}),
                                              ("POST", COMPLETIONS, {"prompt": "x", "model": "gpt-x"}),
                                              ("POST", RESPONSES, {"input": "x", "model": "gpt-x"}),
                                              ("GET", "/v1/models/gpt-x", None)])
def test_an_unknown_model_is_openais_model_not_found(server, method, path, body):
    r = httpx.request(method, server[0] + path, json=body, timeout=30)
    check_error_shape(r, 404, "model")
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")
    assert err["message"].startswith("The model `gpt-x` does not exist or you do not have access to it.")


def test_an_unknown_route_is_openais_unknown_url(server):
    r = httpx.post(server[0] + "/v1/nowhere", json={}, timeout=30)
    check_error_shape(r, 404, None)
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "unknown_url")
    assert "POST /v1/nowhere" in err["message"]


VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:e2e_request_latency_seconds_count", 'vllm:request_success_total{finished_reason="stop"',
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def test_the_vllm_prefix_gives_vllms_names_on_the_server():
    """--metrics-prefix vllm: serves the families under the names vLLM's dashboards and autoscalers read."""
    engine = FakeEngine()
    with serve_engine(engine, metrics_prefix="vllm:") as url:
        assert http((url, engine), "POST", "/v1/completions", {"model": "fake", "prompt": "SAY:hi"},
                    key=None).status_code == 200
        text = http((url, engine), "GET", "/metrics", key=None).text
    for name in VLLM_NAMES:
        assert name in text, name
    assert "radiance_" not in text


@pytest.mark.parametrize("prefix", ["", "9x", "vllm-"])
def test_a_prefix_no_metric_name_starts_with_is_refused(prefix):
    with pytest.raises(ConfigError, match="metrics_prefix"):
        ServerConfig(metrics_prefix=prefix)
