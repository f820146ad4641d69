"""Server follow-ups of the fifty-third session.

1. request_prefill_kv_computed_tokens of a request that ends (client gone) before its first output: the prefix-cache
   hits the engine counted at its admission are asked of the engine, so request_prompt_tokens_sum less
   request_prefill_kv_computed_tokens_sum stays the engine's prefix_cache_hits_total; one never admitted found no
   hits (its whole prompt counts, vLLM's formula for a request not scheduled yet).
2. A request's `tools: []` on /v1/chat/completions is a 400 naming `tools`, as current vLLM answers (and OpenAI):
   it rendered the default template while the kwargs' `tools: []` picks the tool_use one.
3. reasoning_effort low / medium / high set enable_thinking true where the kwargs do not say it (vLLM's
   enable_thinking = effort != "none"); none / minimal false ("minimal" differs from vLLM: OpenAI's minimal is
   almost no reasoning). On both routes, and an opt-in template then opens <think>, which the constraint lets run.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from radiance.engine.sampling_params import SamplingParams
from radiance.server.metrics import ServerMetrics
from radiance.server.serving_common import EngineJob, merged_outputs
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.test_chat_followups import chat
from tests.server.test_request_ids_and_metrics import cancel_consumer_midway
from tests.server.test_server_churn import model_path  # noqa: F401 - a fixture
from tests.server.test_template_kwargs_parity import PROBE
from tests.server.test_thinking_then_constraint import ASK, PLAN, prompt_of, spec_of


@pytest.fixture(scope="module")
def tiny_engine(model_path):
    """The tiny random Llama 3 with a real byte-level BPE tokenizer (the churn suite's), prefix caching on."""
    from radiance import LLM

    return LLM(model_path, device="cpu", dtype="float32", enable_prefix_caching=True).engine


def test_a_request_aborted_before_its_first_output_counts_its_prefix_cache_hits(tiny_engine):
    """A (admitted, 64 cached tokens) and B (still queued: the engine thread is held in A's step) are both left
    before any output. A's computed tokens are its prompt less its 64 hits; B was never admitted, so it found
    none and its whole prompt counts. Either way the prompt sum less the computed sum is the engine's hits."""
    from radiance.engine.async_engine import AsyncLLMEngine

    engine = tiny_engine
    real_launch, gate = engine.runner.launch, threading.Event()
    held = {"on": False}

    def launch(*args, **kwargs):  # holds the engine thread after scheduling: no output can come meanwhile
        if held["on"]:
            assert gate.wait(60)
        return real_launch(*args, **kwargs)

    engine.runner.launch = launch
    metrics = ServerMetrics(engine.stats, lambda: "m", max_model_len=lambda: engine.max_model_len)
    shared = list(range(1, 65))  # 4 full blocks of 16
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    a_prompt, b_prompt = shared + [7] * 40, shared + [9] * 30

    async def consume(job):
        async for _ in merged_outputs(aengine, [job], metrics):
            pass

    async def run():
        await consume(EngineJob("warm", shared, params))  # fills the prefix cache
        hits_before = engine.stats().prefix_cache_hits_total
        held["on"] = True
        a = asyncio.create_task(consume(EngineJob("a", a_prompt, params)))
        for _ in range(3000):  # admitted (its step then waits at the gate)
            if aengine.num_cached_tokens("a") is not None:
                break
            await asyncio.sleep(0.01)
        assert aengine.num_cached_tokens("a") == 64
        b = asyncio.create_task(consume(EngineJob("b", b_prompt, params)))
        await asyncio.sleep(0.05)
        assert "b" in aengine._queues and aengine.num_cached_tokens("b") is None  # queued, not admitted
        for task in (a, b):
            task.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        gate.set()
        for _ in range(3000):  # the aborts applied, the engine idle
            if not engine.has_unfinished_requests() and not aengine._pending:
                break
            await asyncio.sleep(0.01)
        await aengine.shutdown()
        return hits_before

    aengine = AsyncLLMEngine(engine=engine)
    try:
        hits_before = asyncio.run(run())
    finally:
        engine.runner.launch = real_launch
    hits = engine.stats().prefix_cache_hits_total
    assert hits - hits_before == 64  # A's; B never reached the prefix cache

    def value(name):
        return metrics.registry.get_sample_value("radiance_" + name, {"model_name": "m"})

    assert metrics.registry.get_sample_value(
        "radiance_request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 2
    assert value("request_prompt_tokens_count") == 3
    assert value("request_prompt_tokens_sum") == len(shared) + len(a_prompt) + len(b_prompt)
    assert value("request_prefill_kv_computed_tokens_sum") == len(shared) + (len(a_prompt) - 64) + len(b_prompt)
    assert value("request_prompt_tokens_sum") - value("request_prefill_kv_computed_tokens_sum") == hits


def test_the_async_engines_cached_tokens_answer_only_for_a_live_call(tiny_engine):
    """No answer for an id without a live generate call (never sent, or finished)."""
    from radiance.engine.async_engine import AsyncLLMEngine

    async def run():
        aengine = AsyncLLMEngine(engine=tiny_engine)
        async for _ in aengine.generate("done", list(range(1, 20)), SamplingParams(max_tokens=1)):
            pass
        answers = aengine.num_cached_tokens("done"), aengine.num_cached_tokens("never")
        await aengine.shutdown()
        return answers

    assert asyncio.run(run()) == (None, None)


def test_an_engines_failing_cached_tokens_lookup_still_ends_and_aborts_each_job():
    """The lookup runs while merged_outputs unwinds: one that raises leaves that job's hits unknown (its whole
    prompt counted), while the others still get theirs, and every job still ends once and is aborted."""

    class Engine(FakeEngine):
        def num_cached_tokens(self, request_id):
            if request_id == "job-1":
                raise RuntimeError("lookup failed")
            return 16

    engine = Engine()
    metrics = ServerMetrics(lambda: None, lambda: "m", max_model_len=lambda: 512)
    prompt = engine.tokenizer.encode("SAY:SLOW" + "z" * 200)  # still running when the consumer leaves
    jobs = [EngineJob(f"job-{i}", prompt, SamplingParams(max_tokens=500)) for i in range(2)]

    cancel_consumer_midway(engine, jobs, metrics)
    sample = metrics.registry.get_sample_value
    assert sample("radiance_request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 2
    assert sorted(engine.aborted) == ["job-0", "job-1"]
    assert sample("radiance_request_prompt_tokens_sum", {"model_name": "m"}) == 2 * len(prompt)
    assert sample("radiance_request_prefill_kv_computed_tokens_sum", {"model_name": "m"}) == 2 * len(prompt) - 16


# ---------------------------------------------------------------- 2. tools: []

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MSG = [{"role": "user", "content": "SAY:default template"}]


def test_an_empty_tools_field_is_a_400_while_empty_kwargs_tools_pick_the_tool_use_template():
    engine = FakeEngine()
    engine.chat_templates = {"tool_use": "{% for m in messages %}SAY:tool_use template{% endfor %}"}

    def post(**fields):
        return httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": MSG, **fields}, timeout=30)

    with serve_engine(engine, tool_call_parser="hermes") as url:
        for fields in ({"tools": []}, {"tools": [], "tool_choice": "none"}):
            r = post(**fields)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "empty" in r.json()["error"]["message"]
        # the kwargs' tools: [] is a render with tools (transformers' `tools is not None`), as before
        r = post(chat_template_kwargs={"tools": []})
        assert r.json()["choices"][0]["message"]["content"] == "tool_use template", r.text
        # tools given with tool_choice "none": still rendered (vLLM's default), so the tool_use template
        r = post(tools=[TOOL], tool_choice="none")
        assert r.json()["choices"][0]["message"]["content"] == "tool_use template", r.text
        # a Responses request's tools: [] is OpenAI's "no tools" there, never sent on as chat's tools
        r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "SAY:no tools", "tools": []},
                       timeout=30)
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "no tools", r.text
        # /tokenize renders as chat: the same 400 (it built a chat request from its fields: a 500)
        r = httpx.post(url + "/tokenize", json={"model": "fake", "messages": MSG, "tools": []}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ---------------------------------------------------------------- 3. reasoning_effort -> enable_thinking

@pytest.mark.parametrize("effort,kwargs,thinking", [
    ("low", None, "True"), ("medium", None, "True"), ("high", None, "True"),
    ("none", None, "False"), ("minimal", None, "False"),
    ("high", {"enable_thinking": False}, "False"),  # the kwargs say it: they win
    ("none", {"enable_thinking": True}, "True"),
    ("high", {"enable_thinking": None}, "True"),  # a null kwarg is unset
    (None, None, "unset"),
])
def test_reasoning_effort_sets_enable_thinking_on_both_routes(effort, kwargs, thinking):
    engine = FakeEngine(chat_template=PROBE)
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    with serve_engine(engine) as url:
        body = {"model": "fake", "messages": [{"role": "user", "content": "SAY:hi"}], **extra}
        if effort:
            body["reasoning_effort"] = effort
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert f"[thinking={thinking}]" in prompt_of(engine), prompt_of(engine)
        body = {"model": "fake", "input": "SAY:hi", **extra}
        if effort:
            body["reasoning"] = {"effort": effort}
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert f"[thinking={thinking}]" in prompt_of(engine), prompt_of(engine)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_reasoning_effort_opens_an_opt_in_templates_thinking_before_the_constraint(route):
    """The fake TEMPLATE opens <think> only with enable_thinking (opt-in, as Gemma 4's): reasoning_effort high
    opens it, so the reasoning runs free and the constraint holds the answer after </think> ("think"); with
    "none" it stays closed and the answer is held from the start."""
    engine = FakeEngine(max_model_len=2048)
    engine.reply = PLAN + '</think>\n\n{"a": 1}'
    with serve_engine(engine, reasoning_parser="think") as url:
        for effort, opened in (("high", True), ("none", False)):
            if route == "chat":
                message, _ = chat(url, {"messages": ASK, "response_format": {"type": "json_object"},
                                        "reasoning_effort": effort}, False)
                answer, reasoning = message.get("content"), message.get("reasoning_content")
            else:
                r = httpx.post(url + "/v1/responses", json={
                    "model": "fake", "input": ASK, "text": {"format": {"type": "json_object"}},
                    "reasoning": {"effort": effort}}, timeout=30)
                assert r.status_code == 200, r.text
                items = {item["type"]: item for item in r.json()["output"]}
                answer = items["message"]["content"][0]["text"] if "message" in items else None
                reasoning = items["reasoning"]["content"][0]["text"] if "reasoning" in items else None
            assert prompt_of(engine).endswith("<|assistant|><think>") == opened, prompt_of(engine)
            assert spec_of(engine).after_reasoning == ("think" if opened else None)
            if opened:
                assert (reasoning, answer) == (PLAN, '{"a": 1}')
