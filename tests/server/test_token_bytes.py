"""Logprobs' `bytes`: each token's own raw bytes, so that tokens splitting a character join back into it (they
were the UTF-8 of U+FFFD, which each such token decodes to alone), for the tokenizer families radiance serves."""

from __future__ import annotations

import pytest

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.gguf_reader import embedded_model_path
from radiance.engine.outputs import TokenLogprob
from radiance.server.logprobs_json import chat_logprobs
from radiance.server.token_bytes import token_bytes
from tests.engine.conftest import tiny_byte_bpe_tokenizer
from tests.engine.test_detok_families import SPLIT_TEXT, byte_ids, sentencepiece_tokenizer


@pytest.fixture(scope="module", params=["smollm2", "byte_bpe", "llama2", "mistral"])
def tokenizer(request):
    if request.param == "smollm2":  # the embedded model's GPT-2 style byte-level BPE, as the server reads it
        return open_checkpoint(embedded_model_path()).tokenizer()
    if request.param == "byte_bpe":
        return tiny_byte_bpe_tokenizer()
    return sentencepiece_tokenizer(metaspace_decoder=request.param == "mistral")


def _bytes_of(tokenizer, ids: list[int]) -> bytes:
    texts = {i: tokenizer.decode([i]) for i in ids}
    raw = token_bytes(tokenizer, list(dict.fromkeys(ids)), texts)
    return b"".join(bytes(raw[i]) for i in ids)


def test_tokens_that_split_characters_join_back_into_them(tokenizer):
    ids = byte_ids(tokenizer, "東京🙂")  # one token per UTF-8 byte: each decodes alone to U+FFFD
    assert all(tokenizer.decode([i]) == "\ufffd" for i in ids)
    assert _bytes_of(tokenizer, ids) == "東京🙂".encode()


def test_a_tokenized_text_joins_back_into_its_bytes(tokenizer):
    ids = tokenizer(SPLIT_TEXT, add_special_tokens=False).input_ids
    # SentencePiece spells the text's first space "▁" too: its bytes have it, decode strips it
    assert _bytes_of(tokenizer, ids).decode().lstrip(" ") == SPLIT_TEXT


def test_chat_logprobs_carry_the_raw_bytes_of_chosen_and_alternative_tokens(tokenizer):
    first, second = byte_ids(tokenizer, "é")
    entries = [TokenLogprob(first, -0.5, [(first, -0.5), (second, -2.0)]), TokenLogprob(second, -0.1)]
    content = chat_logprobs(tokenizer, entries)["content"]
    assert [c["token"] for c in content] == ["\ufffd", "\ufffd"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "é"
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [content[0]["bytes"], content[1]["bytes"]]


def test_special_tokens_keep_their_text(tokenizer):
    special = tokenizer.all_special_ids[0]
    text = tokenizer.decode([special])
    assert _bytes_of(tokenizer, [special]) == text.encode()
