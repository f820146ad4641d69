"""radiance.engine.beam_search: vLLM's LLM.beam_search over LLM.generate. The embedded SmolLM2 (on the exact float32
path, so that a sequence scores the same in any batch) checks it against greedy decoding and teacher-forced
logprobs; a tiny 12-token model checks it against an exhaustive search and at the context's end."""

from __future__ import annotations

import math

import numpy
import pytest

from radiance import LLM, SamplingParams
from radiance.engine.beam_search import (BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_search,
                                         create_sort_beams_key_function, get_beam_search_score)
from radiance.engine.request_checks import ContextLengthError, SamplingParamsError
from tests.engine.conftest import tiny_hf_model

TOL = 1e-3
TINY_VOCAB = 12
TINY_EOS = 2  # Llama's default eos_token_id, the engine's EOS for this tokenizer-less model


@pytest.fixture(scope="module")
def llm():
    """The embedded SmolLM2 with its Q4_1 linears dequantized to float32 (cpu_int4=False): the int4 kernel's
    numerics change with the batch's size, and these tests compare one sequence scored in different batches."""
    built = LLM(device="cpu", max_num_seqs=8, cpu_int4=False)
    built.progress = False
    return built


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 12-token Llama without a tokenizer (token-id prompts, EOS 2 from its config), context 8."""
    path = tmp_path_factory.mktemp("beam-tiny")
    tiny_hf_model("llama3", seed=3, vocab_size=TINY_VOCAB).save_pretrained(path)
    built = LLM(str(path), device="cpu", dtype="float32", max_model_len=8)
    built.progress = False
    return built


def _score(tokens: list[int], cum: float, eos: int, length_penalty: float) -> float:
    """vLLM's get_beam_search_score, written out again: the length counts the prompt, not a final EOS."""
    return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty


def _teacher_forced(llm, sequences) -> list[float]:
    """Each sequence's output logprob sum, from the prompt_logprobs of its whole token list (one generate call)."""
    outs = llm.generate([s.tokens for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                       temperature=0.0), use_tqdm=False)
    sums = []
    for seq, out in zip(sequences, outs):
        start = len(seq.tokens) - len(seq.output_token_ids)
        sums.append(sum(out.prompt_logprobs[i][seq.tokens[i]].logprob for i in range(start, len(seq.tokens))))
    return sums


# ------------------------------------------------------------------------------------------- the embedded model

def test_width_one_is_greedy_decoding(llm):
    prompt = "The capital of France is"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert greedy.finish_reason == "length"  # no EOS on the way: beam search would set it aside
    [out] = beam_search(llm, [prompt], BeamSearchParams(beam_width=1, max_tokens=3))
    assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 1
    seq = out.sequences[0]
    assert seq.output_token_ids == greedy.token_ids
    assert seq.tokens == llm.tokenizer(prompt).input_ids + greedy.token_ids
    assert seq.text == llm.tokenizer.decode(seq.tokens) and seq.text.startswith(prompt)  # vLLM's: prompt + output
    assert seq.finish_reason == "length" and seq.stop_reason is None
    assert len(seq.logprobs) == 3 and all(len(step) == 2 for step in seq.logprobs)  # 2 * beam_width candidates


def test_width_three_scores_at_least_greedy_and_reports_true_logprobs(llm):
    prompt = "The capital of France is"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    [out] = beam_search(llm, [{"prompt": prompt}], BeamSearchParams(beam_width=3, max_tokens=3))
    seqs = out.sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    assert all(len(s.output_token_ids) == 3 and s.finish_reason == "length" for s in seqs)
    assert seqs[0].cum_logprob >= greedy.cumulative_logprob - TOL
    # the reported cumulative logprobs are the model's: the same tokens teacher-forced in one prefill
    for seq, forced in zip(seqs, _teacher_forced(llm, seqs)):
        assert seq.cum_logprob == pytest.approx(forced, abs=TOL)
        assert seq.cum_logprob == pytest.approx(sum(step[t].logprob for step, t in
                                                    zip(seq.logprobs, seq.output_token_ids)), abs=1e-9)
    # best first, by vLLM's score (equal lengths here, so by cumulative logprob)
    assert [s.cum_logprob for s in seqs] == sorted((s.cum_logprob for s in seqs), reverse=True)


def test_eos_completes_a_beam_unless_ignore_eos(llm):
    """After "Yes." in a chat answer SmolLM2's likeliest token is <|im_end|>, its EOS."""
    tokenizer = llm.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say yes"}], tokenize=False,
                                           add_generation_prompt=True) + "Yes."
    eos = tokenizer.eos_token_id
    [out] = beam_search(llm, [prompt], BeamSearchParams(beam_width=2, max_tokens=3))
    best = out.sequences[0]
    assert best.output_token_ids == [eos]  # it ended there: no tokens after EOS
    assert best.finish_reason == "stop" and best.stop_reason == eos
    assert best.text == prompt + tokenizer.eos_token  # vLLM decodes the EOS too
    assert all(eos not in s.output_token_ids[:-1] for s in out.sequences)
    [kept] = beam_search(llm, [prompt], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert all(len(s.output_token_ids) == 3 and s.finish_reason == "length" for s in kept.sequences)
    assert kept.sequences[0].output_token_ids[0] == eos  # the same start, gone on past the EOS


def test_beam_width_past_max_logprobs_is_refused_before_generating(llm):
    with pytest.raises(SamplingParamsError, match="beam_width 11 asks for 22 logprobs.*max_logprobs 20") as err:
        beam_search(llm, ["Hi"], BeamSearchParams(beam_width=11, max_tokens=1))
    assert err.value.field == "beam_width"


# ----------------------------------------------------------------------------------------------- the tiny model

def _exhaustive(llm, prompt: list[int], length_penalty: float, ignore_eos: bool):
    """Every output of at most 2 tokens (1 when it is EOS, unless ignore_eos), scored from direct generate calls
    that return the whole vocabulary's logprobs: [(score, output tokens, cumulative logprob)], best first."""
    full = SamplingParams(max_tokens=1, logprobs=TINY_VOCAB, temperature=0.0)
    first = llm.generate([prompt], full, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert len(first) == TINY_VOCAB
    heads = [t for t in first if ignore_eos or t != TINY_EOS]
    seconds = llm.generate([prompt + [t] for t in heads], full, use_tqdm=False)
    found = [] if ignore_eos else [([TINY_EOS], first[TINY_EOS].logprob)]
    for head, out in zip(heads, seconds):
        found += [([head, t], first[head].logprob + lp.logprob) for t, lp in out.outputs[0].logprobs[0].items()]
    scored = [(_score(prompt + toks, cum, TINY_EOS, length_penalty), toks, cum) for toks, cum in found]
    return sorted(scored, key=lambda x: x[0], reverse=True)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_full_width_search_is_the_exhaustive_search(tiny, length_penalty, ignore_eos):
    """beam_width = the vocabulary: no candidate is ever cut, so the beam_width best of 2 steps are exactly the
    beam_width best of all continuations by vLLM's score; EOS sequences end at their EOS unless ignore_eos."""
    prompt = [6]  # EOS is its third likeliest next token
    params = BeamSearchParams(beam_width=TINY_VOCAB, max_tokens=2, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    [out] = beam_search(tiny, [prompt], params)
    assert all(TINY_EOS not in s.output_token_ids[:-1] for s in out.sequences) or ignore_eos
    expected = _exhaustive(tiny, prompt, length_penalty, ignore_eos)[:TINY_VOCAB]
    assert [s.output_token_ids for s in out.sequences] == [toks for _, toks, _ in expected]
    for seq, (score, _, cum) in zip(out.sequences, expected):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-5)
        assert get_beam_search_score(seq.tokens, seq.cum_logprob, TINY_EOS, length_penalty) == pytest.approx(score)
        ended = seq.output_token_ids[-1] == TINY_EOS and not ignore_eos  # at step 1 or 2
        assert (seq.finish_reason, seq.stop_reason) == (("stop", TINY_EOS) if ended else ("length", None))
        assert seq.text is None  # no tokenizer to decode with
    if length_penalty == 0.0 and not ignore_eos:  # the EOS sequence is in play: the 1-token output ranks high
        assert [TINY_EOS] in [s.output_token_ids for s in out.sequences]


def test_length_penalty_reorders_as_the_formula_says(tiny):
    """A 1-token EOS output against 2-token ones: favoured with penalty 0 (raw sums), not with 2.5."""
    prompt = [6]
    ranks = {}
    for lp in (0.0, 2.5):
        [out] = beam_search(tiny, [prompt], BeamSearchParams(beam_width=4, max_tokens=2, length_penalty=lp))
        outputs = [s.output_token_ids for s in out.sequences]
        ranks[lp] = outputs.index([TINY_EOS]) if [TINY_EOS] in outputs else None
        keys = [_score(s.tokens, s.cum_logprob, TINY_EOS, lp) for s in out.sequences]
        assert keys == sorted(keys, reverse=True)
    assert ranks[0.0] is not None and (ranks[2.5] is None or ranks[2.5] > ranks[0.0])


def test_prompt_forms_batching_and_concurrency_limit_agree(tiny):
    params = BeamSearchParams(beam_width=3, max_tokens=2)
    prompts = [[6], {"prompt_token_ids": [5, 7, 3]}, [1, 4]]
    together = beam_search(tiny, prompts, params)
    one_by_one = beam_search(tiny, prompts, params, concurrency_limit=1)
    alone = [beam_search(tiny, p, params, use_tqdm=True)[0] for p in ([6], [5, 7, 3], {"prompt_token_ids": [1, 4]})]
    for a, b, c in zip(together, one_by_one, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences] == [s.tokens for s in c.sequences]
        for x, y in zip(a.sequences, c.sequences):
            assert x.cum_logprob == pytest.approx(y.cum_logprob, abs=1e-5)
    assert together[1].sequences[0].orig_prompt["prompt_token_ids"] == [5, 7, 3]
    assert beam_search(tiny, [], params) == []
    # one prompt as a 1-D array, as generate takes it (it was refused as "got ndarray")
    [array] = beam_search(tiny, numpy.array([5, 7, 3]), params)
    assert [s.tokens for s in array.sequences] == [s.tokens for s in together[1].sequences]


def test_output_stops_at_the_context(tiny):
    """max_model_len 8: a 6-token prompt leaves 2 tokens however large max_tokens is; an 8-token one none."""
    [out] = beam_search(tiny, [[5, 7, 3, 4, 4, 4]], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert [len(s.output_token_ids) for s in out.sequences] == [2, 2]
    with pytest.raises(ContextLengthError):
        beam_search(tiny, [[6], [5] * 8], BeamSearchParams(beam_width=2, max_tokens=1))


# ------------------------------------------------------------------------------------------- score and params

def test_score_by_hand():
    eos = 2
    # a final EOS is not counted: length 3, so -3 / 3 ** p
    assert get_beam_search_score([5, 6, 7, 2], -3.0, eos, 1.0) == pytest.approx(-1.0)
    assert get_beam_search_score([5, 6, 7, 2], -3.0, eos, 2.0) == pytest.approx(-3.0 / 9)
    assert get_beam_search_score([5, 6, 7, 8], -3.0, eos, 1.0) == pytest.approx(-0.75)
    assert get_beam_search_score([5, 6, 7, 8], -3.0, eos, 0.0) == pytest.approx(-3.0)
    assert get_beam_search_score([5, 6, 7, 2], -3.0, None, 1.0) == pytest.approx(-0.75)  # no EOS known
    assert get_beam_search_score([5, 6, 7, 2], -3.0, frozenset({2, 9}), 1.0) == pytest.approx(-1.0)
    # the ranking turns on the penalty: short A (-2.0 over 4 tokens, prompt included) against long B (-2.7 over 6)
    a = BeamSearchSequence({"prompt_token_ids": [1, 1]}, [1, 1, 3, 4], cum_logprob=-2.0)
    b = BeamSearchSequence({"prompt_token_ids": [1, 1]}, [1, 1, 3, 4, 5, 6], cum_logprob=-2.7)
    for lp, scores, best in ((0.0, (-2.0, -2.7), a),  # raw sums
                             (0.5, (-1.0, -2.7 / 6 ** 0.5), a),  # -1.0 against -1.102
                             (1.0, (-0.5, -0.45), b)):  # per token: B's is better
        key = create_sort_beams_key_function(eos, lp)
        assert (key(a), key(b)) == pytest.approx(scores)
        assert sorted((b, a), key=key, reverse=True)[0] is best


@pytest.mark.parametrize("kwargs, field, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width", "beam_width must be at least 1, got 0"),
    (dict(beam_width=2, max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0"),
    (dict(beam_width=2, max_tokens=4, temperature=-0.5), "temperature",
     "temperature must be non-negative, got -0.5"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width", "beam_width must be an integer"),
    (dict(beam_width=True, max_tokens=4), "beam_width", "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty", "length_penalty must be finite"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="no"), "ignore_eos", "ignore_eos must be true or false"),
])
def test_bad_params_are_refused_by_name(kwargs, field, message):
    with pytest.raises(SamplingParamsError, match=message) as err:
        BeamSearchParams(**kwargs)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


def test_bad_call_arguments(tiny):
    params = BeamSearchParams(beam_width=2, max_tokens=1)
    with pytest.raises(SamplingParamsError, match="params must be BeamSearchParams"):
        beam_search(tiny, [[6]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="concurrency_limit must be a positive integer"):
        beam_search(tiny, [[6]], params, concurrency_limit=0)
    with pytest.raises(ValueError, match="prompts must be a list"):
        beam_search(tiny, 6, params)
    with pytest.raises(ValueError, match="prompt_token_ids"):  # an id past the vocabulary, before any step
        beam_search(tiny, [[6], [TINY_VOCAB]], params)
