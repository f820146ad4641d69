"""vLLM's bad_words: each word tokenized with and without a leading space (no special tokens); a one-token word is
always banned, a longer one bans its last token where the output so far ends with its other tokens. The ban needs
the newest output token on the host, so under overlapped decode such a sequence is sampled only once the host has
it (as a structured output's is)."""

from __future__ import annotations

import re

import pytest
import torch

from radiance import SamplingParams
from radiance.engine.model_runner import sampling_rows
from radiance.engine.request_checks import MAX_BAD_WORDS, RequestError, tokenize_bad_words
from radiance.engine.sampling_params import tokenized_bad_words
from radiance.engine.scheduler import ScheduledSequence
from radiance.engine.sequence import Sequence
from radiance.layers.sampler import BadWords, LogitAdjustment, SamplingRow, adjust_logits, sample


class WordTokenizer:
    """One token per word, a word after a space its own token ("Ġ" + word), as byte-level BPE vocabularies have
    it; BOS (0) first unless add_special_tokens is False."""

    def __init__(self):
        self.vocab = {"<s>": 0}

    def encode(self, text, add_special_tokens=True):
        pieces = ["Ġ" + p[1:] if p.startswith(" ") else p for p in re.findall(r" ?\S+|\s", text)]
        return [0] * add_special_tokens + [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]


def _occurs(word, tokens) -> bool:
    n = len(word)
    return any(tuple(tokens[i:i + n]) == tuple(word) for i in range(len(tokens) - n + 1))


# ---------------------------------------------------------------- tokenization


def test_each_word_is_tokenized_with_and_without_a_leading_space():
    tok = WordTokenizer()
    ids = tokenize_bad_words(["  new york", "hi"], tok)
    v = tok.vocab
    assert ids == ((v["new"], v["Ġyork"]), (v["Ġnew"], v["Ġyork"]), (v["hi"],), (v["Ġhi"],))
    assert 0 not in {t for word in ids for t in word}  # no BOS


def test_the_spaced_spelling_counts_only_with_as_many_tokens_and_another_first_token():
    from tests.server.fake_engine import ByteTokenizer

    # bytes: " hi" is one token longer than "hi", so only "hi" counts (vLLM's rule)
    assert tokenize_bad_words(["hi", " x"], ByteTokenizer()) == ((104, 105), (120,))
    # a word of whitespace only (vLLM fails on it) is encoded as it is, once
    assert tokenize_bad_words(["\n"], ByteTokenizer()) == ((10,),)


def test_bad_words_errors_name_the_field():
    from tests.server.fake_engine import ByteTokenizer

    with pytest.raises(RequestError, match="bad_words has 129 words; at most 128") as err:
        tokenize_bad_words([f"w{i}" for i in range(MAX_BAD_WORDS + 1)], ByteTokenizer())
    assert err.value.field == "bad_words"
    with pytest.raises(RequestError, match="outside the vocabulary") as err:
        tokenized_bad_words(SamplingParams(bad_words=["hi"]), ByteTokenizer(), vocab_size=100)
    assert err.value.field == "bad_words"
    with pytest.raises(RequestError, match="tokenize to 1030 tokens; at most 1024"):
        tokenized_bad_words(SamplingParams(bad_words=["x" * 1030]), ByteTokenizer(), vocab_size=300)
    with pytest.raises(RequestError, match="need the model's tokenizer") as err:
        tokenized_bad_words(SamplingParams(bad_words=["hi"]), None, vocab_size=300)
    assert err.value.field == "bad_words"
    with pytest.raises(RequestError, match="not valid UTF-8"):
        tokenize_bad_words(["a\ud800"], ByteTokenizer())
    # token ids given: used as they are, without a tokenizer
    assert tokenized_bad_words(SamplingParams(bad_words_token_ids=[[5, 6], [7]]), None, 10) == ((5, 6), (7,))
    assert tokenized_bad_words(SamplingParams(), None, 10) == ()


class CountingTokenizer(WordTokenizer):
    def __init__(self):
        super().__init__()
        self.encoded: list[str] = []

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(text)
        return super().encode(text, add_special_tokens)


def test_over_the_limits_is_refused_early_and_not_cached():
    """128 words of 22 kB each took 2 s to tokenize on the server's event loop (the 400 came after it), and each
    refused list was cached (142 MiB for four): now a list too long for the longest token is refused before any
    tokenizing, tokenizing stops once past the limits (as vLLM's), and nothing refused is cached."""
    tokenizer = CountingTokenizer()
    with pytest.raises(RequestError, match="bad_words have 4100 characters: more than the 1024 tokens"):
        tokenize_bad_words(["x" * 2050, "y" * 2050], tokenizer, max_token_chars=4)
    assert tokenizer.encoded == []
    words = [" ".join(f"w{i}_{j}" for j in range(20)) for i in range(100)]  # 20 tokens a spelling, two spellings
    for _ in range(2):  # refused both times: the first refusal was not cached
        tokenizer.encoded.clear()
        with pytest.raises(RequestError, match="tokenize to 1040 tokens; at most 1024"):
            tokenize_bad_words(words, tokenizer, max_token_chars=16)
        assert len(tokenizer.encoded) == 2 * 26  # stopped at the 26th word, where the sum passed 1024
    within = words[:20]
    assert tokenize_bad_words(within, tokenizer, max_token_chars=16) == tokenize_bad_words(within, tokenizer)
    # words given beside an empty list of ids are tokenized (the empty list banned nothing)
    assert tokenized_bad_words(SamplingParams(bad_words=["hi"], bad_words_token_ids=[]), WordTokenizer(), 10)


@pytest.mark.parametrize("fields, message", [
    (dict(bad_words="hi"), "bad_words must be a list of strings"),
    (dict(bad_words=["hi", 3]), "bad_words must be a list of strings"),
    (dict(bad_words=["hi", ""]), "bad_words must be non-empty strings"),
    (dict(bad_words_token_ids=[5]), "bad_words_token_ids must be a list of lists of integers"),
    (dict(bad_words_token_ids=[[1.5]]), "bad_words_token_ids must be a list of lists of integers"),
    (dict(bad_words_token_ids=[[True]]), "bad_words_token_ids must be a list of lists of integers"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids must not hold an empty list"),
    (dict(bad_words_token_ids=[[3, -1]]), "bad_words_token_ids must be non-negative"),
])
def test_sampling_params_check_bad_words(fields, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**fields)


def test_sampling_params_keep_bad_words():
    p = SamplingParams(bad_words=["a", "b c"], bad_words_token_ids=[[1], (2, 3)])
    assert p.bad_words == ("a", "b c") and p.bad_words_token_ids == ((1,), (2, 3))
    assert p.adjusts_logits and SamplingParams(bad_words=["x"]).adjusts_logits
    assert SamplingParams(bad_words=None).bad_words == () and not SamplingParams(bad_words=[]).adjusts_logits
    assert p.for_choice(1).bad_words_token_ids == p.bad_words_token_ids


# ---------------------------------------------------------------- the ban


def test_a_one_token_word_is_always_banned_a_longer_one_only_after_its_prefix():
    bad = BadWords([(7,), (3, 4), (3, 3, 5), (9, 3, 6), (1, 2, 3, 8)])
    assert bad.needs_output and bad.context == 3
    assert bad.banned([]) == (7,)
    assert bad.banned([5, 3]) == (4, 7)  # after 3: (3, 4)'s 4; (9, 3, 6) needs 9 before the 3
    assert bad.banned([9, 3]) == (4, 6, 7)
    assert bad.banned([3, 3]) == (4, 5, 7)
    assert bad.banned([1, 2, 3]) == (4, 7, 8)
    assert bad.banned([2, 3]) == (4, 7)  # the prefix (1, 2, 3) only in part
    assert bad.banned([3, 4]) == (7,)
    only_single = BadWords([(7,), (2,)])
    assert not only_single.needs_output and only_single.banned([3, 3]) == (2, 7)


def test_the_ban_reads_the_output_only_not_the_prompt():
    seq = Sequence("r", [1, 3], SamplingParams(), 0)
    seq.bad_words = BadWords([(3, 4)])
    assert seq.bans_after(0) == ()  # the prompt ends with 3: vLLM matches the output tokens only
    seq.append_token(3)
    assert seq.bans_after(1) == (4,)
    seq.append_token(5)
    assert seq.bans_after(2) == ()


def test_the_sampler_bans_per_row_and_leaves_other_rows_alone():
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0, -1.0]]).repeat(3, 1)
    bad = BadWords([(1,), (2, 4)])
    rows = [SamplingRow(0.0, adjust=LogitAdjustment(banned=bad.banned([0]))),
            SamplingRow(0.0),
            SamplingRow(0.0, adjust=LogitAdjustment(banned=bad.banned([0, 2])))]
    out = adjust_logits(logits, rows)
    assert torch.isneginf(out[0, 1]) and not torch.isinf(out[0, [0, 2, 3, 4, 5]]).any()
    assert torch.equal(out[1], logits[1])
    assert torch.isneginf(out[2, [1, 4]]).all() and out[2, 0] == 1.0
    assert sample(logits, rows).token_ids == [4, 1, 2]


def test_sampling_rows_ban_after_the_output_the_host_has():
    tok = ScheduledSequence
    seq = Sequence("a", [9, 9], SamplingParams(max_tokens=8), 0)
    seq.bad_words = BadWords([(5,), (2, 3)])
    free = Sequence("b", [9, 2], SamplingParams(max_tokens=8), 1)
    seq.append_token(2)
    free.append_token(2)
    rows = sampling_rows([tok(seq, 1), tok(free, 1)], 16, torch.device("cpu"), pending=False)
    assert rows[0].adjust.banned == (3, 5) and rows[1].adjust is None
    # a token still on the device (overlapped decode): a word of several tokens cannot be matched
    assert seq.samples_after_host and not free.samples_after_host
    with pytest.raises(RuntimeError, match="before the host had its previous token"):
        sampling_rows([tok(seq, 1)], 16, torch.device("cpu"), pending=True)
    single = Sequence("c", [9], SamplingParams(max_tokens=8), 2)
    single.bad_words = BadWords([(5,)])
    assert not single.samples_after_host  # a one-token word is banned the same whatever came before
    assert sampling_rows([tok(single, 1)], 16, torch.device("cpu"), pending=True)[0].adjust.banned == (5,)


# ---------------------------------------------------------------- the engine


PROMPTS = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100))]


def _free(llm, prompts=PROMPTS, max_tokens=16):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _words_from(out: list[int]) -> tuple[tuple[int, ...], ...]:
    """A one-token word of the free output, and a two-token one whose first token occurs in the output without
    its second somewhere (so the ban must depend on what came before)."""
    single = (out[len(out) // 2],)
    for i in range(len(out) - 1):
        pair = (out[i], out[i + 1])
        if single[0] not in pair and any(out[j] == pair[0] and out[j + 1] != pair[1] for j in range(len(out) - 1)):
            return single, pair
    for i in range(len(out) - 1):  # no such pair: any pair without the single word's token
        if single[0] not in (out[i], out[i + 1]):
            return single, (out[i], out[i + 1])
    raise AssertionError(f"no two-token word in {out}")


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_never_writes_a_bad_word(tiny_llm, overlap):
    llm = tiny_llm(max_num_seqs=4, overlap_decode=overlap)
    plain = _free(llm)
    words = _words_from(plain[0])
    assert all(_occurs(w, plain[0]) for w in words)  # not vacuous: the free output writes them
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, bad_words_token_ids=words)
    steps = llm.engine.overlapped_steps
    outs = llm.generate(PROMPTS + [PROMPTS[0]], [params, params, SamplingParams(max_tokens=16, temperature=0.0,
                                                                                 ignore_eos=True)])
    got = [o.outputs[0].token_ids for o in outs]
    for out in got[:2]:
        assert len(out) == 16 and not any(_occurs(w, out) for w in words), (words, out)
    assert got[0] != plain[0]
    assert got[2] == plain[0]  # batched beside them, a free request keeps its own tokens
    if overlap:  # the forward is still queued ahead; only the sampling waits for the host
        assert llm.engine.overlapped_steps > steps
    # random sampling too
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, bad_words_token_ids=words)
    for out in llm.generate(PROMPTS, seeded):
        assert not any(_occurs(w, out.outputs[0].token_ids) for w in words)


def test_overlapped_and_in_order_decode_give_the_same_tokens(tiny_llm):
    llm = tiny_llm(max_num_seqs=4, overlap_decode=False)
    plain = _free(llm, max_tokens=24)
    words = _words_from(plain[0]) + _words_from(plain[1])
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, bad_words_token_ids=words),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, bad_words_token_ids=words[2:]),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=3,
                             bad_words_token_ids=words[:1])]  # one-token words only: sampled ahead as before
    prompts = PROMPTS + [[4, 4, 4]]
    in_order = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    overlapped = tiny_llm(max_num_seqs=4, overlap_decode=True)
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)] == in_order
    assert overlapped.engine.overlapped_steps > 0
    chunked = tiny_llm(max_num_seqs=4, overlap_decode=True, max_num_batched_tokens=16)  # prefill chunks beside
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == in_order


def test_engine_refuses_bad_words_it_cannot_serve(tiny_llm):
    llm = tiny_llm()
    with pytest.raises(RequestError, match="need the model's tokenizer") as err:
        llm.generate([[1, 2, 3]], SamplingParams(bad_words=["hi"]))
    assert err.value.field == "bad_words"
    with pytest.raises(RequestError, match=r"bad_words has token id\(s\) outside the vocabulary"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(bad_words_token_ids=[[5, 256]]))
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_as_text_with_the_models_tokenizer(tiny_text_llm):
    llm = tiny_text_llm(max_num_seqs=2)
    tokenizer = llm.tokenizer
    prompt = "Paris is the capital of"
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = llm.generate(prompt, free)[0].outputs[0].token_ids
    # words of the free output's text whose tokenization (either spelling) it writes
    words = []
    for t in dict.fromkeys(plain):
        word = tokenizer.decode([t]).strip()
        if word and any(_occurs(ids, plain) for ids in tokenize_bad_words([word], tokenizer)):
            words.append(word)
    assert words, [tokenizer.decode([t]) for t in plain]
    words = words[:3]
    ids = tokenize_bad_words(words, tokenizer)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                              bad_words=words))[0].outputs[0].token_ids
    assert out != plain and not any(_occurs(w, out) for w in ids), (words, ids, out)
