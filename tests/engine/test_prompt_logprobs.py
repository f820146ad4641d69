"""SamplingParams.prompt_logprobs against a no-cache forward of the whole prompt, under every scheduling."""

from __future__ import annotations

import pytest
import torch

from radiance import SamplingParams

PROMPTS = [list(range(30, 70)), [5, 9, 9, 200, 17, 3, 3, 3, 41, 250, 7, 100, 64, 2, 88, 91, 12, 12, 0, 77]]


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16), dict(enable_prefix_caching=True),
                                     dict(num_gpu_blocks_override=6, max_num_batched_tokens=32)],
                         ids=["plain", "chunked", "prefix-cache", "preemption"])
def test_prompt_logprobs_match_a_full_forward(tiny_llm, options):
    llm = tiny_llm(max_num_seqs=4, **options)
    if options.get("enable_prefix_caching"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0))  # cached, yet must be rescored
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    model = llm.engine.runner.model
    for prompt, out in zip(PROMPTS, outs):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None  # one entry per prompt token, none twice
        ref = model.forward_logits(torch.tensor([prompt]))[0].float().log_softmax(-1)
        for p in range(1, len(prompt)):
            token, *alternatives = got[p]  # vLLM's {token id: Logprob}: the prompt token, then the others
            assert token == prompt[p]
            assert got[p][token].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
            top = ref[p - 1].topk(3).indices.tolist()
            assert alternatives == [t for t in top if t != token]
            # vLLM's rank: 1 + the tokens more likely (a token within the logprobs' tolerance may go either way)
            row, target = ref[p - 1], ref[p - 1, prompt[p]]
            assert 1 + int((row > target + 1e-4).sum()) <= got[p][token].rank <= 1 + int((row > target - 1e-4).sum())
    if "num_gpu_blocks_override" in options:
        assert llm.engine.stats().num_preemptions > 0
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_zero_gives_the_chosen_token_only(tiny_llm):
    out = tiny_llm().generate([1, 2, 3, 4], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[2], [3], [4]]
