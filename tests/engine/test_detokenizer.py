"""Incremental detokenization: the DecodeStream path and the window path both give the full decode's text,
append only, and hold back an incomplete character, on byte-level BPE and Metaspace (SentencePiece-style)
tokenizers."""

from __future__ import annotations

import random

import pytest

from radiance.engine.detokenizer import IncrementalDetokenizer, _StreamDecoder, _WindowDecoder
from tests.engine.conftest import tiny_byte_bpe_tokenizer

TEXT = ["Grüße aus Köln — 東京 🙂 ok?  Spaces\tand\nlines.", "The quick brown fox jumps over the lazy dog.",
        '{"name": "Ann", "age": 31}', "Paris is the capital of France."]


def metaspace_tokenizer():
    """A BPE with a Metaspace pre-tokenizer and decoder ("▁" for spaces, the first one dropped on decode), as
    Llama 2 / Mistral tokenizers work, plus a byte fallback so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_],
                                  show_progress=False)
    tok.train_from_iterator(TEXT * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte_bpe", "metaspace", "smollm2"])
def tokenizer(request):
    if request.param == "byte_bpe":
        return tiny_byte_bpe_tokenizer()
    if request.param == "metaspace":
        return metaspace_tokenizer()
    return request.getfixturevalue("smollm2").tokenizer


def stream_text(tokenizer, prompt: list[int], ids: list[int], stream: bool, stop=()) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop, stream=stream)
    kind = _StreamDecoder if stream else _WindowDecoder
    assert isinstance(detok.decoder, kind)  # the path under test is the one serving
    seen = []
    for t in ids:
        if detok.add_token(t):
            break
        seen.append(detok.text)
    return seen + [detok.text]


@pytest.mark.parametrize("stream", [True, False])
def test_text_equals_the_full_decode_and_only_grows(tokenizer, stream):
    rng = random.Random(0)
    for text in TEXT:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        # the prompt ends anywhere, mid-word included, but after a whole character
        cuts = [c for c in range(1, len(ids)) if not tokenizer.decode(ids[:c]).endswith("\ufffd")]
        for cut in rng.sample(cuts, 3):
            prompt, gen = ids[:cut], ids[cut:]
            expected = tokenizer.decode(prompt + gen)[len(tokenizer.decode(prompt)):]
            seen = stream_text(tokenizer, prompt, gen, stream)
            assert seen[-1] == expected
            assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # only ever appends
            assert not any("\ufffd" in s for s in seen)  # an incomplete character is held back


@pytest.mark.parametrize("stream", [True, False])
def test_special_tokens_skipped_and_stop_strings_cut(tokenizer, stream):
    eos = tokenizer.eos_token_id
    ids = tokenizer("Paris is the capital of France.", add_special_tokens=False).input_ids
    seen = stream_text(tokenizer, [eos], ids[:3] + [eos] + ids[3:], stream)
    assert seen[-1] == tokenizer.decode(ids)  # the special token in the middle adds no text
    cut = stream_text(tokenizer, [eos], ids, stream, stop=("capital",))
    assert cut[-1] == "Paris is the "


def test_both_paths_agree_on_random_token_streams(tokenizer):
    """Arbitrary ids (split multi-byte characters, ids past the vocabulary as a padded model may sample)."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(5):
        ids = [rng.randrange(vocab + 8) for _ in range(60)]
        assert stream_text(tokenizer, [1, 2], ids, True)[-1] == stream_text(tokenizer, [1, 2], ids, False)[-1]


def test_a_prompt_ending_mid_character_does_not_leak_into_the_text(tokenizer, request):
    """A prompt of token ids may stop inside a multi-byte character. DecodeStream primed with such a tail gave
    the tail's text back with the first token ("Gr" + "üße" for a prompt "Gr" + half of "ü"); both paths now
    give the window's text, which starts after the prompt's last whole character."""
    tried = 0
    for text in TEXT:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for cut in [c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]).endswith("\ufffd")]:
            tried += 1
            prompt, gen = ids[:cut], ids[cut:]
            expected = tokenizer.decode(prompt + gen)[len(tokenizer.decode(prompt)):]
            for stream in (True, False):
                detok = IncrementalDetokenizer(tokenizer, prompt, stream=stream)
                for t in gen:
                    detok.add_token(t)
                assert detok.text == expected, (text, cut, stream)
    # the byte-level tokenizers split TEXT's characters across tokens: without a cut nothing was checked (the
    # metaspace one, trained on TEXT, holds each character whole)
    assert tried or request.node.callspec.params["tokenizer"] == "metaspace"
