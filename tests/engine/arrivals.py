"""Requests that arrive while others run: the engine's mixed steps (a prefill next to decodes)."""

from __future__ import annotations


def staggered_outputs(llm, prompts, params, every: int = 3, loras=None) -> dict:
    """{request id: token ids} when prompt i arrives after every * i engine steps, so that its prefill
    shares steps with the decodes of the prompts before it; `loras`: prompt i's LoRA adapter (or None)."""
    engine, done, arrived, steps = llm.engine, {}, 0, 0
    while arrived < len(prompts) or engine.has_unfinished_requests():
        if arrived < len(prompts) and steps >= every * arrived:
            lora = {} if loras is None else {"lora_request": loras[arrived]}
            engine.add_request(f"r{arrived}", prompts[arrived], params, **lora)
            arrived += 1
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done
