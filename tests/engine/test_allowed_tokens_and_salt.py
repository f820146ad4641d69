"""vLLM's allowed_token_ids (a mask on the logits, CPU sampler and engine) and cache_salt (prefix-cache blocks
shared only under the same salt)."""

from __future__ import annotations

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.block_manager import BlockManager
from radiance.engine.request_checks import RequestError
from radiance.engine.sequence import Sequence
from radiance.layers.sampler import LogitAdjustment, SamplingRow, adjust_logits, sample


def _only(ids, vocab=6) -> torch.Tensor:
    mask = torch.ones(vocab, dtype=torch.bool)
    mask[list(ids)] = False
    return mask


def test_the_mask_leaves_only_the_allowed_tokens_and_other_rows_alone():
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0, -1.0]]).repeat(3, 1)
    rows = [SamplingRow(0.0, num_logprobs=1, adjust=LogitAdjustment(disallowed=_only([2, 3]))),
            SamplingRow(0.0),  # no list: unchanged
            SamplingRow(0.0, adjust=LogitAdjustment(bias=((3, 10.0),), disallowed=_only([2, 3, 5])))]
    out = adjust_logits(logits, rows)
    assert torch.isneginf(out[0, [0, 1, 4, 5]]).all() and out[0, 2] == 2.0 and out[0, 3] == 0.0
    assert torch.equal(out[1], logits[1])
    assert out[2, 3] == 10.0 and not torch.isinf(out[2, 5])
    s = sample(logits, rows)
    assert s.token_ids == [2, 1, 3]
    assert s.logprobs[0][0] == pytest.approx(logits[0].log_softmax(-1)[2].item())  # the model's own logprob


def test_random_sampling_never_leaves_the_allowed_tokens():
    torch.manual_seed(0)
    logits = torch.randn(64, 6) * 3
    rows = [SamplingRow(1.5, adjust=LogitAdjustment(disallowed=_only([1, 4]))) for _ in range(64)]
    assert set(sample(logits, rows).token_ids) == {1, 4}


def test_a_min_tokens_ban_of_every_allowed_token_keeps_the_mask():
    # allowed only EOS (5) while min_tokens bans it: all -inf picked token 0, which the list refused
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0, 3.0, -1.0]])
    row = SamplingRow(0.0, adjust=LogitAdjustment(banned=(5,), disallowed=_only([5])))
    assert sample(logits, [row]).token_ids == [5]


@pytest.mark.parametrize("bad, message", [([], "must not be empty"), ([-1], "must be non-negative"),
                                          ([1.5], "must be a list of integers"),
                                          ([True], "must be a list of integers")])
def test_sampling_params_check_allowed_token_ids(bad, message):
    with pytest.raises(ValueError, match=f"^allowed_token_ids {message}"):
        SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=[3, 1, 3]).allowed_token_ids == (1, 3)
    assert SamplingParams(allowed_token_ids=[3]).adjusts_logits and not SamplingParams().adjusts_logits


def test_engine_outputs_only_allowed_tokens(tiny_llm):
    llm = tiny_llm(max_num_seqs=4, overlap_decode=True)
    prompts = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100))]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    allowed = (7, 8, 9, 10)
    assert not all(t in allowed for out in plain for t in out)  # not vacuous: free greedy leaves the list
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True, seed=1,
                                allowed_token_ids=allowed)
        # batched with a free request: its tokens stay its own
        outs = llm.generate(prompts + [prompts[0]], [params, params, free])
        assert all(t in allowed for o in outs[:2] for t in o.outputs[0].token_ids)
        assert outs[2].outputs[0].token_ids == plain[0]
    with pytest.raises(RequestError, match=r"allowed_token_ids has token id\(s\) outside the vocabulary") as err:
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(allowed_token_ids=[5, 256]))
    assert err.value.field == "allowed_token_ids"


def _computed(bm: BlockManager, tokens: list[int], salt: str | None, request_id: str = "r") -> Sequence:
    seq = Sequence(request_id, tokens, SamplingParams(cache_salt=salt), 0)
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return seq


def test_cache_salt_separates_prefix_cache_pools():
    bm = BlockManager(num_blocks=16, block_size=2)
    bm.free(_computed(bm, [1, 2, 3, 4, 5], "tenant-a"))
    bm.free(_computed(bm, [1, 2, 3, 4, 5], None))

    def reused(salt):
        return bm.match_prefix(Sequence("probe", [1, 2, 3, 4, 9], SamplingParams(cache_salt=salt), 0))

    assert reused("tenant-a") == 4 and reused(None) == 4  # same salt (or none): shared
    assert reused("tenant-b") == 0  # another salt: nothing of tenant-a's or the unsalted pool
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")
