"""Logit bias and repetition / frequency / presence penalties: the sampler against a hand-written
reference, and the engine's greedy tokens against a step-by-step reference run of the same model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.request_checks import RequestError
from radiance.layers.sampler import LogitAdjustment, OutputCounts, SamplingRow, adjust_logits, sample


def reference_adjust(row: torch.Tensor, bias=(), repetition=1.0, frequency=0.0, presence=0.0, prompt=(),
                     output=()) -> torch.Tensor:
    """The formulas one token at a time: bias, then repetition (prompt and output), frequency, presence."""
    out = row.float().clone()
    for token, b in bias:
        out[token] += b
    if repetition != 1.0:
        for token in set(prompt) | set(output):
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out


def adjustment(bias=(), repetition=1.0, frequency=0.0, presence=0.0, prompt=(), output=(), vocab=40):
    """A LogitAdjustment as the runner builds it, with the token lists kept for the reference."""
    counts = None
    if repetition != 1.0 or frequency or presence:
        counts = OutputCounts(vocab, torch.device("cpu"), list(prompt) if repetition != 1.0 else None)
        counts.catch_up(list(output[:1]))  # caught up in two steps, as the runner does
        counts.catch_up(list(output[1:]))
    a = LogitAdjustment(tuple(bias), repetition, frequency, presence, counts)
    a.lists = (list(prompt), list(output))
    return a


ADJUSTMENTS = [
    dict(bias=((4, 2.5), (9, -100.0)), repetition=1.3, frequency=0.4, presence=0.7, prompt=[1, 2, 3, 3],
         output=[3, 5, 5, 7, 5]),
    dict(repetition=0.8, prompt=[0, 39]),  # below 1 favours repeats
    dict(frequency=-0.5, presence=1.5, output=[11, 11, 12]),
    dict(bias=((0, 7.0),)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adjusted_rows_match_the_formulas_and_others_stay(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 40) * 3).to(dtype)
    before = logits.clone()
    adj = [adjustment(**a) for a in ADJUSTMENTS]
    rows = [SamplingRow(0.0, adjust=adj[0]), SamplingRow(1.0), SamplingRow(0.0, adjust=adj[1]),
            SamplingRow(0.7, adjust=adj[2]), SamplingRow(0.0), SamplingRow(0.0, adjust=adj[3])]
    out = adjust_logits(logits, rows)
    assert out.dtype == torch.float32 and torch.equal(logits, before)  # the model's logits stay for logprobs
    for i, row in enumerate(rows):
        a = row.adjust
        want = logits[i].float() if a is None else reference_adjust(
            logits[i], a.bias, a.repetition, a.frequency, a.presence, *a.lists)
        torch.testing.assert_close(out[i], want, rtol=0, atol=1e-5)
    assert not torch.equal(out[0], logits[0].float())  # the adjustment really moved something
    assert adjust_logits(logits, [SamplingRow(0.0)] * 6) is logits  # nothing asked: untouched, no copy


def test_a_token_still_on_the_device_counts_as_output():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    known = [SamplingRow(0.0, adjust=adjustment(repetition=1.2, frequency=0.3, presence=0.2, prompt=[4],
                                                output=[6, 8, 8], vocab=30)),
             SamplingRow(0.0, adjust=adjustment(frequency=1.0, output=[2], vocab=30))]
    pending = [SamplingRow(0.0, adjust=adjustment(repetition=1.2, frequency=0.3, presence=0.2, prompt=[4],
                                                  output=[6, 8], vocab=30)),
               SamplingRow(0.0, adjust=adjustment(frequency=1.0, output=[], vocab=30))]
    want = adjust_logits(logits, known)
    got = adjust_logits(logits, pending, pending=torch.tensor([8, 2]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(adjust_logits(logits, pending), want)
    assert pending[1].adjust.output.counts.sum() == 0  # the pending token is not kept in the sequence's counts


def test_bias_steers_greedy_choice_and_logprobs_stay_the_models():
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0]])
    ban = SamplingRow(0.0, num_logprobs=1, adjust=adjustment(bias=((1, -100.0),), vocab=4))
    force = SamplingRow(0.0, num_logprobs=1, adjust=adjustment(bias=((3, 100.0),), vocab=4))
    out = sample(logits.repeat(2, 1), [ban, force])
    assert out.token_ids == [2, 3]
    raw = logits[0].log_softmax(-1)
    assert out.logprobs[0][0] == pytest.approx(raw[2].item()) and out.logprobs[1][0] == pytest.approx(raw[3].item())
    assert out.logprobs[0][1] == [(1, pytest.approx(raw[1].item()))]  # the unmodified top alternative


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(logit_bias={3: 101}), dict(logit_bias={-1: 1})])
def test_sampling_params_reject_out_of_range_adjustments(bad):
    with pytest.raises(ValueError, match=f"^{next(iter(bad))} "):  # the message names the parameter
        SamplingParams(**bad)


PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=2.0,
                           frequency_penalty=1.5, presence_penalty=0.5, logit_bias={17: 1.5, 165: -100.0})


def _reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding over full-sequence forwards (no cache), the adjustment applied by the formulas."""
    tokens, out = list(prompt), []
    for _ in range(params.max_tokens):
        logits = model.forward_logits(torch.tensor([tokens], device=model.model.embed_tokens.weight.device))[0, -1]
        adjusted = reference_adjust(logits, params.logit_bias, params.repetition_penalty, params.frequency_penalty,
                                    params.presence_penalty, prompt, out)
        out.append(int(adjusted.argmax()))
        tokens.append(out[-1])
    return out


@pytest.mark.parametrize("options", [dict(), dict(overlap_decode=True), dict(max_num_batched_tokens=16),
                                     dict(num_gpu_blocks_override=6, max_num_batched_tokens=32, overlap_decode=True)],
                         ids=["plain", "overlap", "chunked", "preemption"])
def test_engine_greedy_tokens_follow_the_reference(tiny_llm, options):
    llm = tiny_llm(max_num_seqs=4, **options)
    prompts = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100)), [200, 201]]
    outs = llm.generate(prompts, PENALIZED)
    model = llm.engine.runner.model
    for prompt, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference_greedy(model, prompt, PENALIZED)
        assert 165 not in o.outputs[0].token_ids
    if options.get("overlap_decode"):
        assert llm.engine.overlapped_steps > 0
    if "num_gpu_blocks_override" in options:  # recomputed sequences keep their counts
        assert llm.engine.stats().num_preemptions > 0
    # not vacuous: plain greedy repeats tokens within 24 here (the first output also starts with token 165)
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for p, o in zip(plain, outs):
        assert len(set(p.outputs[0].token_ids)) < 24 and p.outputs[0].token_ids != o.outputs[0].token_ids


def test_engine_refuses_a_bias_outside_the_vocabulary(tiny_llm):
    llm = tiny_llm()
    message = r"^logit_bias has token id\(s\) outside the vocabulary \[0, 256\): \[256\]$"
    with pytest.raises(RequestError, match=message) as err:
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(logit_bias={256: 1.0}))
    assert err.value.field == "logit_bias"
