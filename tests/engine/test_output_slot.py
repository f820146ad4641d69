"""A generate call that reads slowly gets the newest output, not a queue of every step's (each output is cumulative:
a queue held a copy of all tokens and logprobs per step, memory growing with the square of the output)."""

from __future__ import annotations

import asyncio

from radiance import SamplingParams
from radiance.engine.async_engine import AsyncLLMEngine, OutputSlot
from radiance.engine.outputs import StepOutput


def _output(n: int, finished: bool = False) -> StepOutput:
    return StepOutput("r", [1], "x" * n, list(range(n)), None, "length" if finished else None, finished)


def test_the_slot_keeps_the_newest_output_and_never_replaces_an_error():
    async def run():
        slot = OutputSlot()
        for n in (1, 2, 3):
            slot.put_nowait(_output(n))
        assert (await slot.get()).token_ids == [0, 1, 2]  # the newest: it holds the two before it
        slot.put_nowait(_output(4, finished=True))
        assert (await slot.get()).finished
        error = RuntimeError("engine died")
        slot.put_nowait(error)
        slot.put_nowait(_output(5))  # an error ends the call: nothing replaces it
        assert await slot.get() is error
        waiting = asyncio.ensure_future(slot.get())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # empty: the reader waits
        slot.put_nowait(_output(6))
        assert (await waiting).token_ids == list(range(6))

    asyncio.run(run())


def test_a_slow_reader_gets_the_same_text_and_logprobs_in_fewer_outputs(tiny_text_llm):
    engine = tiny_text_llm(max_num_seqs=2).engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = engine.tokenizer("The capital of France").input_ids

    async def read(request_id: str, pause: float) -> list:
        async_engine = AsyncLLMEngine(engine=engine)
        seen = []
        try:
            async for out in async_engine.generate(request_id, prompt, params):
                seen.append(out)
                await asyncio.sleep(pause)  # a client that reads slower than the engine steps
        finally:
            await async_engine.shutdown()
        return seen

    fast = asyncio.run(read("fast", 0.0))
    slow = asyncio.run(read("slow", 0.5))
    assert len(fast) == 24 and len(slow) < len(fast)  # steps the slow reader skipped were merged into later ones
    last_fast, last_slow = fast[-1], slow[-1]
    assert last_slow.finished and last_slow.token_ids == last_fast.token_ids and last_slow.text == last_fast.text
    assert [lp.token_id for lp in last_slow.logprobs] == last_slow.token_ids == [lp.token_id for lp in last_fast.logprobs]
