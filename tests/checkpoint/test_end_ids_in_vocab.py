"""End-of-generation ids beyond the vocabulary (a broken export): dropped with a warning naming the file and
the field, as llama.cpp drops a GGUF's ("bad special token ... using default id", llama-vocab.cpp), for GGUF
and HF checkpoints alike. Was: kept, so generation waited for a token the model can never produce."""

from __future__ import annotations

import json
import logging
import os

import pytest

from radiance.checkpoint import open_checkpoint
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.checkpoint.test_gguf_chat_templates import spm_tokenizer
from tests.checkpoint.test_gguf_metadata import VOCAB, write_gguf
from tests.checkpoint.test_models_followups import CHATML, bpe_tokenizer


def _warned(ckpt, *words) -> bool:
    return any(all(w in line for w in words) for line in ckpt.warnings)


def test_a_gguf_eos_beyond_the_vocabulary_is_dropped_with_a_warning(tmp_path, caplog):
    path = str(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(**{"tokenizer.ggml.eos_token_id": VOCAB + 4,
                                                                        "tokenizer.ggml.eot_token_id": 2})))
    with caplog.at_level(logging.WARNING):
        ckpt = open_checkpoint(path)
    assert ckpt.eos_token_ids == [2]
    assert _warned(ckpt, "tokenizer.ggml.eos_token_id", str(VOCAB + 4), f"vocabulary of {VOCAB}", path)
    assert "tokenizer.ggml.eos_token_id" in caplog.text  # on the console too, not only in `inspect`


def test_a_gguf_eot_beyond_the_vocabulary_leaves_the_turn_end_to_its_text(tmp_path):
    """The bad <|im_end|> id dropped, <|im_end|> is found by its text as when no end of a turn is named."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=bpe_tokenizer(CHATML, eos=0, eot=VOCAB)))
    assert ckpt.eos_token_ids == [0, 2]
    assert _warned(ckpt, "tokenizer.ggml.eot_token_id", str(VOCAB))


def test_a_guessed_end_id_beyond_the_model_vocabulary_is_dropped(tmp_path):
    """A token list longer than the model's vocabulary ({arch}.vocab_size): its <|im_end|> cannot be produced."""
    specials = ["<|endoftext|>"] + [f"x{i}" for i in range(VOCAB - 1)] + ["<|im_end|>"]  # <|im_end|> is id VOCAB
    meta = bpe_tokenizer([], eos=0)
    meta.update({"tokenizer.ggml.tokens": specials, "tokenizer.ggml.token_type": [3] + [1] * (VOCAB - 1) + [3],
                 "llama.vocab_size": VOCAB})
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=meta))
    assert ckpt.eos_token_ids == [0]
    assert _warned(ckpt, "<|im_end|>", str(VOCAB), f"vocabulary of {VOCAB}")


def test_ids_inside_the_vocabulary_warn_of_nothing(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(
        **{"tokenizer.ggml.eot_token_id": VOCAB - 1})))
    assert ckpt.eos_token_ids == [2, VOCAB - 1] and ckpt.warnings == []


def test_an_hf_generation_config_eos_beyond_the_vocabulary_is_dropped(tmp_path, caplog):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    with open(os.path.join(path, "generation_config.json"), "w") as handle:
        json.dump({"eos_token_id": [2, TINY["vocab_size"]]}, handle)
    with caplog.at_level(logging.WARNING):
        ckpt = open_checkpoint(path)
    assert ckpt.eos_token_ids == [2]
    assert _warned(ckpt, "generation_config.json", "eos_token_id", str(TINY["vocab_size"]),
                   f"vocabulary of {TINY['vocab_size']}")
    assert "eos_token_id" in caplog.text


def test_an_hf_config_eos_beyond_the_vocabulary_is_dropped(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), dict(TINY, eos_token_id=-1))
    ckpt = open_checkpoint(path)
    assert ckpt.eos_token_ids == []
    assert _warned(ckpt, os.path.join(path, "config.json"), "eos_token_id", "-1")


def test_an_hf_eos_inside_the_vocabulary_warns_of_nothing(tmp_path):
    ckpt = open_checkpoint(write_dir(str(tmp_path), dense_state_dict(), TINY))
    assert ckpt.eos_token_ids == [2] and ckpt.warnings == []


@pytest.mark.parametrize("name", ["eos", "bos", "padding"])
def test_a_special_id_beyond_the_token_list_names_its_field_when_the_tokenizer_is_built(tmp_path, name):
    """Was: transformers' "list index out of range"; the file still opens (and serves token-id prompts)."""
    key = f"tokenizer.ggml.{name}_token_id"
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(**{key: VOCAB + 4})))
    with pytest.raises(CheckpointError, match=f"{key} is {VOCAB + 4}, beyond the {VOCAB} tokens") as info:
        ckpt.tokenizer()
    assert info.value.file == str(tmp_path / "m.gguf")
