"""The embedded SmolLM2: the CLI answers, chat, stop strings, incremental detokenization, async engine."""

from __future__ import annotations

import asyncio

import pytest

from radiance import SamplingParams
from radiance.engine.detokenizer import IncrementalDetokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_cli_generate_answers_paris(capsys):
    from radiance.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "12", "--device", "cpu"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_chat_and_stop_string(smollm2):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    out = smollm2.chat(QUESTION, greedy)[0].outputs[0]
    assert "Paris" in out.text
    assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    stopped = smollm2.chat(QUESTION, SamplingParams(max_tokens=12, temperature=0.0, stop=["France"]))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert "France" not in stopped.text and out.text.startswith(stopped.text) and stopped.text


def test_eos_ends_generation(smollm2):
    out = smollm2.chat(QUESTION, SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop"  # the answer is one short sentence, then <|im_end|>
    assert out.token_ids[-1] in smollm2.engine.eos_token_ids


def test_incremental_detokenizer_matches_full_decode(smollm2):
    tok = smollm2.tokenizer
    text = "Grüße aus Köln — 東京 🙂 ok?  Spaces\tand\nlines."
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    seen = []
    for t in ids:
        detok.add_token(t)
        seen.append(detok.text)
        assert "\ufffd" not in detok.text
    assert detok.text == tok.decode(ids)
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # only ever appends


def test_async_engine_streams_and_aborts(smollm2):
    from radiance.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(engine=smollm2.engine)
    tok = smollm2.tokenizer
    prompt = tok(smollm2.apply_chat_template(QUESTION), add_special_tokens=False).input_ids
    expected = smollm2.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids

    async def run():
        async def collect(rid):
            outs = [o async for o in engine.generate(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0))]
            return outs

        async def abandon():
            agen = engine.generate("gone", prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
            first = await agen.__anext__()
            await agen.aclose()  # like a client disconnect
            return first

        results = await asyncio.gather(collect("a"), collect("b"), abandon())
        with pytest.raises(ValueError):
            async for _ in engine.generate("bad", [], SamplingParams()):
                pass
        for _ in range(50):  # the aborted request leaves the engine
            if not smollm2.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return results

    a, b, first = asyncio.run(run())
    assert a[-1].token_ids == expected and b[-1].token_ids == expected
    assert all(len(x.token_ids) < len(y.token_ids) for x, y in zip(a, a[1:]))  # streamed step by step
    assert a[-1].finished and not first.finished
    assert not smollm2.engine.has_unfinished_requests()


def test_streamed_text_never_shows_a_partial_stop_string(smollm2):
    tok = smollm2.tokenizer
    ids = tok("The capital of France is Paris.", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [1, 2, 3], stop=("is Paris",))
    shown = []
    for t in ids:
        if detok.add_token(t):
            break
        shown.append(detok.visible_text())
    assert detok.text == "The capital of France "  # cut before the stop string
    assert all(not s.endswith(("i", "is", "is ")) for s in shown)  # held back while it could still match
    assert all(detok.text.startswith(s) for s in shown)  # nothing shown that the stop later removed
