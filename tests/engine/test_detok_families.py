"""Incremental detokenization against the full decode, per tokenizer family: the embedded SmolLM2 (GPT-2
byte-level BPE with added special tokens), a Llama 2 style SentencePiece BPE (Metaspace "▁" spaces, byte
tokens <0xE2> as ordinary vocabulary, the first leading space stripped) and a Mistral style one (a Metaspace
decoder). Invariant: the streamed text only grows, never shows U+FFFD for a character whose bytes are merely
split across tokens, and once finished equals decode(prompt + output) after decode(prompt)."""

from __future__ import annotations

import json
import random
import time

import pytest

from radiance.engine.detokenizer import IncrementalDetokenizer, _StreamDecoder, _WindowDecoder
from tests.engine.conftest import tiny_byte_bpe_tokenizer

ASCII_TEXT = ["The quick brown fox jumps over the lazy dog.", '{"name": "Ann", "age": 31}',
              "Paris is the capital of France.", "hello world, hello again [INST] and <tool> calls"]
SPLIT_TEXT = "Hi 🙂 東京 ok — Grüße"  # emoji and CJK: byte tokens in the SentencePiece families


def sentencepiece_tokenizer(metaspace_decoder: bool = False):
    """A byte-fallback BPE as Llama 2 (Replace/ByteFallback/Fuse/Strip decoder) or Mistral (Metaspace decoder)
    ship it: "▁" for spaces, the 256 byte tokens <0x00>..<0xFF> in the ordinary vocabulary (not special, so
    skip_special_tokens keeps them), special [INST]/[/INST] and a non-special added token <tool>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(ASCII_TEXT * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    if metaspace_decoder:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                         decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)])
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    fast.add_tokens(["<tool>"])
    return fast


@pytest.fixture(scope="module")
def llama2():
    return sentencepiece_tokenizer()


@pytest.fixture(scope="module", params=["smollm2", "byte_bpe", "llama2", "mistral"])
def tokenizer(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2").tokenizer
    if request.param == "byte_bpe":
        return tiny_byte_bpe_tokenizer()
    if request.param == "llama2":
        return request.getfixturevalue("llama2")
    return sentencepiece_tokenizer(metaspace_decoder=True)


def decode(tokenizer, ids: list[int], skip: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip)


def expected_text(tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    full, before = decode(tokenizer, prompt + output, skip), decode(tokenizer, prompt, skip)
    assert full.startswith(before)
    return full[len(before):]


def detokenize(tokenizer, prompt, output, stream: bool, skip: bool = True, stop=(), include_stop=False):
    """(texts shown after each token, the final text, whether a stop string ended it)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip, stop=stop, stream=stream, include_stop=include_stop)
    assert isinstance(detok.decoder, _StreamDecoder if stream else _WindowDecoder)
    shown = []
    for t in output:
        if detok.add_token(t):
            return shown, detok.finish(), True
        shown.append(detok.visible_text())
    return shown, detok.finish(), False


def assert_streams_as_decoded(tokenizer, prompt, output, skip: bool = True):
    expected = expected_text(tokenizer, prompt, output, skip)
    for stream in (True, False):
        shown, final, _ = detokenize(tokenizer, prompt, output, stream, skip)
        assert final == expected, (stream, final, expected)
        assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), stream  # only ever appends
        if "\ufffd" not in expected:
            assert not any("\ufffd" in s for s in shown), stream  # a split character is held back whole


def byte_ids(tokenizer, text: str) -> list[int]:
    """`text` spelled one byte token per UTF-8 byte: a SentencePiece vocabulary's <0xNN>, a byte-level BPE's
    single-byte tokens."""
    vocab = tokenizer.get_vocab()
    names = {b: f"<0x{b:02X}>" for b in range(256)} if is_byte_fallback(tokenizer) else gpt2_byte_chars()
    return [vocab[names[b]] for b in text.encode()]


def is_byte_fallback(tokenizer) -> bool:
    return "<0x41>" in tokenizer.get_vocab()


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies spell bytes in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


# ---------------------------------------------------------------------------- characters split over tokens

def test_split_characters_come_out_whole_and_as_decoded(tokenizer):
    prompt = tokenizer("Say:", add_special_tokens=False).input_ids
    assert_streams_as_decoded(tokenizer, prompt, tokenizer(SPLIT_TEXT, add_special_tokens=False).input_ids)
    assert_streams_as_decoded(tokenizer, prompt, byte_ids(tokenizer, SPLIT_TEXT))  # every byte its own token


def test_the_prompt_decides_the_first_leading_space(llama2):
    """"▁world" after a prompt "hello" is " world"; alone it would be "world" (the first space is stripped)."""
    hello, world = (llama2(w, add_special_tokens=False).input_ids for w in ("hello", " world"))
    assert decode(llama2, world) == "world"
    for stream in (True, False):
        assert detokenize(llama2, hello, world, stream)[1] == " world"
        # after a prompt of skipped special tokens only, the full decode strips it, and so does the stream
        inst = llama2.convert_tokens_to_ids("[INST]")
        assert detokenize(llama2, [inst], hello, stream)[1] == expected_text(llama2, [inst], hello) == "hello"


def test_a_prompt_ending_in_split_characters_keeps_the_output_whole(tokenizer):
    """Chinese on Llama 2 is byte tokens, 3 per character. The prompt's last 6 tokens started inside "東" here,
    and byte-fallback decodes a run of byte tokens all or nothing: the output's own "京都" streamed as six
    U+FFFD. The context now starts at a character."""
    for text in ("東é東", "東京é"):
        prompt = tokenizer("Say", add_special_tokens=False).input_ids + byte_ids(tokenizer, text)
        output = byte_ids(tokenizer, "京都") + tokenizer(" ok", add_special_tokens=False).input_ids
        assert_streams_as_decoded(tokenizer, prompt, output)


# ---------------------------------------------------------------------------- bytes that never complete

def test_a_character_the_output_ends_inside_comes_out_at_finish(tokenizer):
    """The output stops after 2 of the 4 bytes of 🙂 (max_tokens, or an EOS that is skipped): the held-back
    bytes were lost; the full decode shows U+FFFD, and now so does the finished text."""
    prompt = tokenizer("Say:", add_special_tokens=False).input_ids
    output = tokenizer(" ok", add_special_tokens=False).input_ids + byte_ids(tokenizer, "🙂")[:2]
    expected = expected_text(tokenizer, prompt, output)  # byte-fallback: one U+FFFD per byte of the run
    assert expected.rstrip("\ufffd") == " ok" and expected.endswith("\ufffd")
    for stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, stream=stream)
        for t in output:
            detok.add_token(t)
        assert detok.visible_text() == " ok"  # held back while generating
        assert detok.finish() == expected
        assert detok.finish() == expected  # added once


def test_a_run_of_invalid_bytes_is_released_and_stays_cheap(smollm2):
    """A model stuck on lone 0xE2 bytes: each decode ended in U+FFFD, so nothing was ever shown and each step
    decoded the whole run again (600 us per token after 3,000). The bytes now come out a few tokens late."""
    tokenizer = smollm2.tokenizer
    lone = byte_ids(tokenizer, "\u20ac")[0]  # 0xE2, the first byte of €
    for stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [1], stream=stream)
        costs = []
        for _ in range(4):  # 4 blocks of 300 tokens
            start = time.perf_counter()
            for _ in range(300):
                detok.add_token(lone)
            costs.append(time.perf_counter() - start)
        assert len(detok.visible_text()) >= 1200 - 8 and set(detok.text) == {"\ufffd"}
        assert costs[-1] < 3 * costs[0] + 0.01, costs
        assert detok.finish() == "\ufffd" * 1200 == decode(tokenizer, [lone] * 1200)


def test_a_split_character_after_invalid_bytes_still_comes_out_whole(tokenizer):
    """Releasing invalid bytes keeps the tail where a real character may be under way."""
    garbage = byte_ids(tokenizer, "\u20ac")[:1] * 12
    # byte-fallback turns a whole byte run invalid: a piece ends the run of garbage there
    piece = tokenizer("ok", add_special_tokens=False).input_ids if is_byte_fallback(tokenizer) else []
    output = garbage + piece + byte_ids(tokenizer, "€🙂 東")
    assert_streams_as_decoded(tokenizer, [tokenizer.eos_token_id], output)


def test_released_bytes_stop_before_a_character_split_around_special_tokens(smollm2):
    """Skipped special tokens inside a split character carry no bytes: releasing invalid bytes by token count
    alone let out the half of 😀 before them as U+FFFD."""
    tokenizer = smollm2.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    smiley = byte_ids(tokenizer, "😀")
    output = byte_ids(tokenizer, "\u20ac")[:1] * 10 + smiley[:2] + [end, end] + smiley[2:]
    assert expected_text(tokenizer, [1], output) == "\ufffd" * 10 + "😀"
    assert_streams_as_decoded(tokenizer, [1], output)


def test_a_byte_run_that_turns_invalid_does_not_raise(llama2):
    """Byte-fallback decodes a run of byte tokens all or nothing: "東" (3 byte tokens) then a stray 0x80 turn
    the whole run into U+FFFD. DecodeStream then raised "Invalid prefix encountered" (the engine step with
    it); the text already streamed stays, and both paths go on the same way."""
    stray = llama2.convert_tokens_to_ids("<0x80>")
    output = byte_ids(llama2, "東") + [stray] + llama2("ok", add_special_tokens=False).input_ids
    texts = [detokenize(llama2, [llama2.eos_token_id], output, stream)[1] for stream in (True, False)]
    assert texts[0] == texts[1]
    assert texts[0].startswith("東") and texts[0].endswith("ok")


# ---------------------------------------------------------------------------- special tokens

@pytest.mark.parametrize("skip", [True, False])
def test_special_and_added_tokens_in_the_middle(tokenizer, skip):
    """No space is put between special tokens (transformers 5 dropped spaces_between_special_tokens): the text
    is the full decode's, skipped or kept."""
    words = tokenizer("hello world", add_special_tokens=False).input_ids
    specials = [t for t in tokenizer.all_special_ids if t != tokenizer.unk_token_id]
    added = [t for t in (tokenizer.convert_tokens_to_ids("<tool>"),) if t != tokenizer.unk_token_id]
    for mid in specials + added:
        output = words[:1] + [mid, mid] + words[1:] + [mid]
        assert_streams_as_decoded(tokenizer, words[:1], output, skip)
        assert_streams_as_decoded(tokenizer, [mid], output, skip)  # the prompt ends in one


# ---------------------------------------------------------------------------- random sequences

def test_random_byte_level_sequences_equal_the_full_decode(smollm2):
    """Byte-level BPE decodes bytes lossily (one U+FFFD per invalid run, stable as bytes are added), so any
    id sequence, random byte tokens and special tokens included, streams to exactly the full decode."""
    tokenizer = smollm2.tokenizer
    rng = random.Random(3)
    single_bytes = [tokenizer.convert_tokens_to_ids(c) for c in gpt2_byte_chars().values()]
    leads = byte_ids(tokenizer, "é€🙂")  # lead and continuation bytes, repeated into invalid runs below

    def pool() -> list[int]:
        roll = rng.random()
        if roll < 0.1:
            return [rng.choice(tokenizer.all_special_ids)]
        if roll < 0.3:
            return [rng.choice(leads)] * rng.randrange(1, 12)
        return [rng.choice(single_bytes) if roll < 0.7 else rng.randrange(len(tokenizer))]

    def random_ids(most: int) -> list[int]:
        return [t for _ in range(rng.randrange(most)) for t in pool()]

    for _ in range(80):
        prompt = tokenizer("Say:", add_special_tokens=False).input_ids + random_ids(3)
        if decode(tokenizer, prompt).endswith("\ufffd"):
            continue
        output = random_ids(40)
        skip = rng.random() < 0.5
        expected = expected_text(tokenizer, prompt, output, skip)
        for stream in (True, False):
            shown, final, _ = detokenize(tokenizer, prompt, output, stream, skip)
            assert final == expected
            assert all(expected.startswith(s) for s in shown)


def test_random_valid_text_over_byte_fallback_equals_the_full_decode(llama2):
    """Characters spelled in byte tokens at random, between random pieces and special tokens, in the prompt
    and in the output."""
    rng = random.Random(4)
    pieces = [i for t, i in llama2.get_vocab().items() if not t.startswith("<0x")]
    chars = "aé—東京🙂ü ß\n"

    def random_ids(most: int) -> list[int]:
        ids = []
        for _ in range(rng.randrange(1, most)):
            ids += byte_ids(llama2, rng.choice(chars)) if rng.random() < 0.6 else [rng.choice(pieces)]
        return ids

    for _ in range(80):
        assert_streams_as_decoded(llama2, random_ids(8), random_ids(25), rng.random() < 0.5)


def test_random_byte_fallback_garbage_streams_without_raising(llama2):
    """Random byte tokens: the full decode turns a whole byte run into U+FFFD once it turns invalid, text that
    was already streamed stays (it cannot be taken back). Nothing raises, the text only grows, and both paths
    give the same text."""
    rng = random.Random(5)
    vocab = llama2.get_vocab()
    bytes_ = [i for t, i in vocab.items() if t.startswith("<0x")]
    for _ in range(60):
        output = [rng.choice(bytes_) if rng.random() < 0.7 else rng.randrange(len(llama2)) for _ in range(40)]
        results = [detokenize(llama2, [llama2.eos_token_id], output, stream) for stream in (True, False)]
        assert results[0][1] == results[1][1]
        for shown, final, _ in results:
            assert all(b.startswith(a) for a, b in zip(shown + [final], shown[1:] + [final]))


# ---------------------------------------------------------------------------- long outputs, stop strings

def test_per_token_cost_stays_flat_over_5000_tokens(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer(" ".join(["Grüße aus Köln — 東京 🙂 ok? The quick brown fox."] * 400),
                    add_special_tokens=False).input_ids[:5000]
    for stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [1], stop=("never seen",), stream=stream)
        costs = []
        for block in range(0, 5000, 1000):
            start = time.perf_counter()
            for t in ids[block:block + 1000]:
                detok.add_token(t)
                detok.visible_text()
            costs.append(time.perf_counter() - start)
        assert costs[-1] < 2.5 * costs[0] + 0.01, costs
        assert detok.finish() == decode(tokenizer, ids)


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_across_tokens_and_split_characters(tokenizer, include_stop):
    """A stop string that starts in one token and ends in another, or inside a character whose bytes are held
    back: the text is cut there, and nothing it cut was ever shown."""
    text = "Hi a🙂 東京 ok done"
    for output in (tokenizer(text, add_special_tokens=False).input_ids, byte_ids(tokenizer, text)):
        for stop in ("a🙂", "🙂 東", "京 o", "k d", "done"):
            cut = text.index(stop) + (len(stop) if include_stop else 0)
            for stream in (True, False):
                shown, final, stopped = detokenize(tokenizer, [tokenizer.eos_token_id], output, stream, stop=(stop,),
                                                   include_stop=include_stop)
                assert stopped and final == text[:cut], (stop, stream, final)
                assert all(final.startswith(s) for s in shown)


def test_the_engine_ends_an_output_cut_inside_a_character_as_the_full_decode_does(tiny_text_llm):
    """max_tokens cut after the first byte of "é": the output text is the full decode's U+FFFD (the engine took
    the detokenizer's text without its held-back bytes, so the output read "")."""
    from radiance.engine.sampling_params import SamplingParams

    llm = tiny_text_llm()
    tokenizer = llm.engine.tokenizer
    first_byte = tokenizer.convert_tokens_to_ids("Ã")
    assert tokenizer.decode([first_byte]) == "\ufffd"  # the byte-level symbol of 0xC3, the lead byte of "é"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logit_bias={first_byte: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([first_byte], "\ufffd", "length")
