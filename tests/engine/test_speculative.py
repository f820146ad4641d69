"""Prompt-lookup (n-gram) speculative decoding: the same tokens as plain decoding, drafts really kept."""

from __future__ import annotations

import pytest

from radiance import SamplingParams
from radiance.config import SpeculativeConfig
from radiance.engine.ngram import may_find_drafts, propose_ngram_drafts


@pytest.mark.parametrize("ids, want", [
    ([1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 1, 2]),  # the longest suffix that occurs earlier
    ([7, 2, 3, 9, 9, 4, 2, 3], [9, 9, 4, 2]),
    ([1, 2, 3, 1, 2, 4, 1, 2], [4, 1, 2]),  # the latest occurrence wins
    ([5, 6, 7, 8], []),  # nothing repeats
    ([3, 3], []),  # too short for n_min = 2
])
def test_drafts_continue_the_latest_earlier_occurrence(ids, want):
    assert propose_ngram_drafts(ids, 4, n_max=3, n_min=2) == want


@pytest.mark.parametrize("ids, n_min, want", [([1, 2, 3, 2], 2, True), ([1, 2, 3, 4], 2, False),
                                              ([1, 2, 3, 1, 2], 3, True), ([1, 2, 3, 2, 1], 3, False),
                                              ([4], 1, True)])
def test_whether_the_next_lookup_can_match(ids, n_min, want):
    assert may_find_drafts(ids, n_min) == want
    for new in (1, 2, 3, 4, 5):  # agrees with the lookup itself, whatever token comes next
        assert not propose_ngram_drafts(ids + [new], 4, n_max=n_min, n_min=n_min) or want


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match=r"ngram_min must be in \[1, ngram_max\], got ngram_min 3 with ngram_max 2"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="ngram_draft_tokens must be in"):
        SpeculativeConfig(ngram_draft_tokens=-1)


LOOPY = [[9, 8, 7, 6, 9, 8, 7, 6, 9, 8], list(range(30, 60)) * 2, [5, 5, 5, 5, 5, 5]]


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16), dict(enable_prefix_caching=False),
                                     dict(overlap_decode=True)],
                         ids=["plain", "small-budget", "no-prefix-cache", "overlap"])
def test_greedy_tokens_equal_plain_decoding_and_drafts_are_kept(tiny_llm, options):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = tiny_llm(**options)
    spec = tiny_llm(ngram_draft_tokens=5, **options)
    for prompt in LOOPY:  # one at a time: speculation serves a lone sequence
        want = plain.generate(prompt, params)[0].outputs[0].token_ids
        got = spec.generate(prompt, params)[0].outputs[0].token_ids
        assert got == want
    e = spec.engine
    assert e.accepted_draft_tokens > 0 and e.draft_tokens > e.accepted_draft_tokens  # kept some, refused some
    if options.get("overlap_decode"):  # kept while the next lookup cannot match (no repeat yet)
        assert e.overlapped_steps > 0


def test_prefix_cache_holds_only_checked_tokens(tiny_llm):
    """After speculative runs, a prompt extending an earlier prompt + output reuses its cached blocks and
    continues exactly as an engine that never speculated."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = tiny_llm(), tiny_llm(ngram_draft_tokens=6)
    first = LOOPY[1]
    out = spec.generate(first, params)[0].outputs[0].token_ids
    assert out == plain.generate(first, params)[0].outputs[0].token_ids
    longer = first + out + [3, 4]
    again, plain_again = spec.generate(longer, params)[0], plain.generate(longer, params)[0]
    # every full block was registered under its checked tokens: as many reused as without speculation
    assert again.num_cached_tokens == plain_again.num_cached_tokens > len(first)
    assert again.outputs[0].token_ids == plain_again.outputs[0].token_ids


def test_stops_inside_kept_drafts_and_skips_rows_it_must_not_speculate(tiny_llm):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = tiny_llm(), tiny_llm(ngram_draft_tokens=8)
    prompt = LOOPY[1]
    full = plain.generate(prompt, params)[0].outputs[0].token_ids
    stop_at = full[20]
    stopped = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop_at,))
    want = plain.generate(prompt, stopped)[0].outputs[0]
    got = spec.generate(prompt, stopped)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    short = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)  # max_tokens caps the drafts
    assert spec.generate(prompt, short)[0].outputs[0].token_ids == full[:7]
    before = spec.engine.draft_tokens
    for p in (SamplingParams(max_tokens=12, temperature=0.8, seed=5), SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5)):
        assert (spec.generate(prompt, p)[0].outputs[0].token_ids == plain.generate(prompt, p)[0].outputs[0].token_ids)
    assert spec.engine.draft_tokens == before


def test_sampled_rows_speculate_and_stay_in_the_vocabulary(tiny_llm):
    spec = tiny_llm(ngram_draft_tokens=4, ngram_min=1)  # any earlier token: random text repeats few pairs
    out = spec.generate(LOOPY[1], SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 30 and all(0 <= t < 256 for t in out.token_ids)
    assert spec.engine.draft_tokens > 0


@pytest.mark.gpu
def test_gpu_speculative_steps_match_cpu_greedy_in_fp32(tiny_llm):
    """The checking step replays the small prefill graph bucket (1 + drafts tokens) on the GPU."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cpu = tiny_llm()
    gpu = tiny_llm(device="cuda", dtype="float32", num_gpu_blocks_override=128, max_num_seqs=4, cuda_graph_max_batch=4,
                   ngram_draft_tokens=7)
    assert 8 in gpu.engine.runner.prefill_graphs.graphs
    for prompt in LOOPY:
        assert gpu.generate(prompt, params)[0].outputs[0].token_ids == cpu.generate(prompt, params)[0].outputs[0].token_ids
    assert gpu.engine.accepted_draft_tokens > 0


@pytest.mark.slow
def test_embedded_model_copying_text_keeps_most_drafts():
    """The real case: asked to repeat a text, the model's output is in its prompt, so most drafts hold
    (CPU, bf16: the same tokens as plain decoding here; in general bf16 rounding may differ between a
    one-token and a several-token step, as with any batching)."""
    from radiance import LLM

    text = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
            "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow.")
    llm = LLM(device="cpu", ngram_draft_tokens=4)
    prompt = llm.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}])
    out = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0]
    stats = llm.engine.stats()
    assert "quick brown fox" in out.text and "judge my vow" in out.text
    assert stats.accepted_draft_tokens_total >= len(out.token_ids) // 2  # most tokens came as kept drafts
    assert stats.draft_tokens_total < 2 * stats.accepted_draft_tokens_total


def test_misses_back_off_the_lookups():
    from types import SimpleNamespace

    from radiance.engine.speculation import MAX_DRAFT_BACKOFF, NgramSpeculator

    seq = SimpleNamespace(draft_misses=0, draft_backoff=0)
    waits = []
    for _ in range(7):
        NgramSpeculator.missed(seq)
        waits.append(seq.draft_backoff)
    assert waits == [1, 2, 4, 8, 16, 16, 16] and MAX_DRAFT_BACKOFF == 16


def test_text_that_never_repeats_keeps_the_overlap(tiny_llm):
    """Lookups that find nothing back off, so most steps stay overlapped; the tokens stay plain decoding's."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = tiny_llm(ngram_draft_tokens=4, ngram_min=1, overlap_decode=True)  # n_min 1: a lookup every step
    plain = tiny_llm(overlap_decode=True)
    prompt = list(range(100, 140))
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain.generate(prompt, params)[0].outputs[0].token_ids
    assert spec.engine.overlapped_steps >= plain.engine.overlapped_steps // 2
