import math

import pytest
import torch

from radiance.bench import metrics


def test_percentile_interpolates_between_ranks():
    data = [10.0, 20.0, 30.0, 40.0]
    # hand computed: position (n-1)*q = 3*0.5 = 1.5 -> 20 + 0.5*10
    assert metrics.percentile(data, 50) == 25.0
    # 3*0.99 = 2.97 -> 30 + 0.97*10
    assert metrics.percentile(data, 99) == pytest.approx(39.7)
    assert metrics.percentile(data, 0) == 10.0
    assert metrics.percentile(data, 100) == 40.0
    assert metrics.percentile([5.0], 99) == 5.0
    assert metrics.percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\], got 101"):
        metrics.percentile(data, 101)


def test_rates():
    assert metrics.tokens_per_second(300, 1.5) == 200.0
    assert math.isnan(metrics.tokens_per_second(10, 0.0))
    # 11 tokens one a chunk: first at 0.2 s, last at 1.2 s -> 10 tokens in 1.0 s
    times = [0.2 + 0.1 * i for i in range(11)]
    assert metrics.decode_tokens_per_second(metrics.inter_token_latencies(times)) == pytest.approx(10.0)
    assert math.isnan(metrics.decode_tokens_per_second(metrics.inter_token_latencies([0.2])))
    # 10 tokens five a chunk at a true 20 tok/s (a token every 50 ms): the first chunk's 5 are the prefill's,
    # the second's 5 took 250 ms. (tokens - 1) / (e2e - ttft) said 36 tok/s.
    gaps = metrics.inter_token_latencies([0.2, 0.45], [5, 5])
    assert metrics.decode_tokens_per_second(gaps) == pytest.approx(20.0)
    assert metrics.inter_token_latencies([1.0, 1.5, 1.75]) == [0.5, 0.25]
    s = metrics.LatencySummary.of([1.0, 2.0, 3.0])
    assert (s.p50, s.mean) == (2.0, 2.0)


def test_kl_against_hand_computed_case():
    # p = (0.5, 0.5), q = (0.25, 0.75): KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    p_logits = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    q_logits = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64)) + 3.0  # a constant shift must not matter
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)
    assert metrics.kl_divergence(p_logits, q_logits).item() == pytest.approx(expected, rel=1e-12)
    # not symmetric: KL(q || p) differs
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert metrics.kl_divergence(q_logits, p_logits).item() == pytest.approx(reverse, rel=1e-12)
    same = torch.randn(4, 7, 11)
    assert torch.all(metrics.kl_divergence(same, same) < 1e-12)
    # a reference with zero mass on a token: 0 log 0 = 0, no NaN
    p_zero = torch.tensor([[0.0, float("-inf")]])
    assert metrics.kl_divergence(p_zero, torch.zeros(1, 2)).item() == pytest.approx(math.log(2.0))
    with pytest.raises(ValueError, match=r"same shape, got \(2, 3\) and \(2, 4\)"):
        metrics.kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_nll_and_perplexity():
    # uniform over V tokens: NLL = ln V per token, perplexity = V
    logits = torch.zeros(1, 5, 8)
    targets = torch.tensor([[1, 2, 3, 4, 5]])
    nll = metrics.token_nll(logits, targets)
    assert nll.shape == (1, 5)
    assert torch.allclose(nll, torch.full((1, 5), math.log(8.0), dtype=torch.float64))
    assert metrics.perplexity(nll.sum().item(), 5) == pytest.approx(8.0)
    # a sharp correct prediction has NLL ~ 0
    sharp = torch.full((1, 1, 4), -1e4)
    sharp[0, 0, 2] = 0.0
    assert metrics.token_nll(sharp, torch.tensor([[2]])).item() == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="at least one token"):
        metrics.perplexity(1.0, 0)


def test_top1_agreement():
    a = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    b = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 1.0]])
    assert metrics.top1_agreement(a, b).tolist() == [1.0, 0.0]


def test_inter_token_latencies_count_the_tokens_of_each_chunk():
    # chunks at 1.0 (2 tokens), 1.4 (2 tokens), 1.5 (1 token): the first chunk's tokens come with the first token
    # time; the second chunk's 0.4 s made two tokens, 0.2 s each
    assert metrics.inter_token_latencies([1.0, 1.4, 1.5], [2, 2, 1]) == pytest.approx([0.2, 0.2, 0.1])
    assert metrics.inter_token_latencies([1.0]) == []
    with pytest.raises(ValueError, match="2 chunk times but 1 token counts"):
        metrics.inter_token_latencies([1.0, 2.0], [1])


def test_tokens_per_chunk_spreads_the_total_evenly():
    assert metrics.tokens_per_chunk(8, 4) == [2, 2, 2, 2]
    assert metrics.tokens_per_chunk(7, 3) == [2, 2, 3] and sum(metrics.tokens_per_chunk(101, 7)) == 101
    assert metrics.tokens_per_chunk(2, 4) == [1, 1, 1, 1]  # every chunk with text holds a token at least
    assert metrics.tokens_per_chunk(0, 0) == []


def test_perplexity_past_float_range_is_inf():
    """exp(800) overflows a float: a garbage variant's perplexity is inf, not an OverflowError ending the run."""
    assert metrics.perplexity(800.0 * 3, 3) == math.inf
    assert metrics.perplexity(709.0, 1) == pytest.approx(math.exp(709.0))


def test_a_later_usage_without_prompt_tokens_keeps_the_count():
    """A first usage with prompt_tokens 5, then a final one with completion_tokens only: the count was reset to
    None, which biased the level's mean prompt length."""
    from radiance.bench.serve_stream import Stream

    stream = Stream()
    stream.add({"choices": [{"index": 0, "text": "a"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}, 0.1)
    stream.add({"choices": [], "usage": {"completion_tokens": 2}}, 0.2)
    assert (stream.prompt_tokens, stream.completion_tokens) == (5, 2)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_scores_by_slices_of_positions_equal_the_whole(monkeypatch, rows):
    """NLL and KL are computed SCORE_ROWS positions at a time (bounded fp64 temporaries); any slicing gives the
    whole computation's numbers, in the input's shape."""
    monkeypatch.setattr(metrics, "SCORE_ROWS", rows)
    gen = torch.Generator().manual_seed(0)
    ref, model = torch.randn(2, 33, 50, generator=gen) * 3, torch.randn(2, 33, 50, generator=gen) * 3
    targets = torch.randint(0, 50, (2, 33), generator=gen)
    logp, ref_logp = torch.log_softmax(model.double(), -1), torch.log_softmax(ref.double(), -1)
    nll = metrics.token_nll(model, targets)
    assert nll.shape == (2, 33)
    assert torch.allclose(nll, -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-12)
    kl = metrics.kl_divergence(ref, model)
    assert kl.shape == (2, 33)
    assert torch.allclose(kl, (ref_logp.exp() * (ref_logp - logp)).sum(-1), rtol=0, atol=1e-12)
