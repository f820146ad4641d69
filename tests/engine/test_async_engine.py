"""The asyncio front of the engine on a tiny model: each `generate` call gets its own request's outputs,
and a request that cannot be added fails alone."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine

PROMPT = [5, 9, 9, 200, 17, 3, 41, 250, 7]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def _collect(engine, request_id, params=GREEDY, take=None):
    outs = []
    async with aclosing(engine.generate(request_id, PROMPT, params)) as stream:
        async for out in stream:
            outs.append(out)
            if take is not None and len(outs) == take:
                break  # leaving the iterator aborts the request
    return outs


async def _drain(engine):
    for _ in range(200):
        if not engine.engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)


def test_a_request_id_reused_after_an_abort_gets_its_own_outputs(tiny_llm):
    """A client that aborts request "r" and sends "r" again at once got the first request's abort as its
    own end (finish_reason "abort", the old tokens), while its real request ran on with nobody reading it."""
    engine = AsyncLLMEngine(engine=tiny_llm(max_num_seqs=4).engine)

    async def run():
        want = (await _collect(engine, "ref"))[-1]
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        first = await _collect(engine, "r", long, take=2)
        again = await _collect(engine, "r")
        await _drain(engine)
        return want, first, again

    want, first, again = asyncio.run(run())
    assert not first[-1].finished
    assert again[-1].finished and again[-1].finish_reason == "length"
    assert again[-1].token_ids == want.token_ids
    assert not engine.engine.has_unfinished_requests()  # no orphan left running


def test_a_request_that_fails_to_add_fails_alone(tiny_llm, monkeypatch):
    """An unexpected error while adding one request (not a ValueError) stopped the engine loop for every
    request, this one's and all later ones."""
    engine = AsyncLLMEngine(engine=tiny_llm(max_num_seqs=4).engine)
    add = engine.engine.add_request

    def add_or_fail(request_id, *args):
        if request_id == "bad":
            raise RuntimeError("boom")
        return add(request_id, *args)

    monkeypatch.setattr(engine.engine, "add_request", add_or_fail)

    async def run():
        try:
            await _collect(engine, "bad")
        except RuntimeError as exc:
            failed = exc
        return failed, await _collect(engine, "good")

    failed, good = asyncio.run(run())
    assert str(failed) == "boom"
    assert engine.errored is None
    assert good[-1].finished and len(good[-1].token_ids) == GREEDY.max_tokens
