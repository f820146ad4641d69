"""Follow-ups on the GGUF reader and model configs: end-of-generation ids guessed from token texts where the
metadata names no end of a turn (as llama.cpp does), gpt-oss layer_types derived as transformers derives them,
and `radiance inspect`'s sliding-window line."""

from __future__ import annotations

import pytest

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.inspect import inspect_lines
from radiance.errors import CheckpointError
from radiance.models.registry import resolve_architecture
from tests.checkpoint.test_gguf_metadata import VOCAB, write_gguf


def bpe_tokenizer(specials: list[str], **ids) -> dict:
    """A gpt2 (BPE) vocabulary of VOCAB tokens starting with `specials`; ids {eos: 0, ...} as metadata."""
    tokens = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (VOCAB - len(specials)),
            "tokenizer.ggml.merges": ["w 0"]}
    meta.update({f"tokenizer.ggml.{name}_token_id": value for name, value in ids.items()})
    return meta


LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
          "<|eot_id|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("arch, specials, ids, want", [
    # an older Llama 3 Instruct conversion: eos <|end_of_text|> only; turns end at <|eot_id|> (and <|eom_id|>)
    ("llama", LLAMA3, {"bos": 0, "eos": 1}, [1, 4, 5]),
    # a Qwen base model's eos is <|endoftext|>: its chat turns end at <|im_end|>
    ("qwen2", CHATML, {"eos": 0}, [0, 2]),
    # no end id at all
    ("qwen3", CHATML, {}, [0, 2]),
])
def test_end_of_turn_tokens_are_found_by_their_text(tmp_path, arch, specials, ids, want):
    """Was: only the declared ids, so a chat reply ran on to max_tokens past <|eot_id|> / <|im_end|>."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", arch=arch, metadata=bpe_tokenizer(specials, **ids)))
    assert ckpt.eos_token_ids == want
    assert any("names no end-of-turn token" in w for w in ckpt.warnings)
    assert any("names no end-of-turn token" in w for w in inspect_lines(ckpt))


@pytest.mark.parametrize("ids", [{"eos": 2}, {"eos": 0, "eot": 2}])
def test_a_declared_end_of_turn_is_taken_at_its_word(tmp_path, ids):
    """SmolLM2's eos is <|im_end|>: <|endoftext|> is not added (and no warning)."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=bpe_tokenizer(CHATML, **ids)))
    assert ckpt.eos_token_ids == sorted(set(ids.values()), key=list(ids.values()).index)
    assert ckpt.warnings == []


def test_a_vocabulary_without_end_texts_guesses_nothing(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=bpe_tokenizer(["<s>", "</s>"], eos=1)))
    assert ckpt.eos_token_ids == [1] and ckpt.warnings == []


def test_a_malformed_end_id_names_the_file_and_key(tmp_path):
    """Was: int("x") raised a bare ValueError when the engine asked for the ids."""
    path = write_gguf(tmp_path / "m.gguf", metadata={**bpe_tokenizer(CHATML), "tokenizer.ggml.eos_token_id": "x"})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.eos_token_id is 'x', not a token id") as info:
        open_checkpoint(path)
    assert info.value.file == path


GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
           "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 8}, {"sliding_window": 8, "use_sliding_window": False},
                                   {"sliding_window": 8, "use_sliding_window": True}, {"sliding_window": None}])
def test_gpt_oss_without_layer_types_alternates_as_transformers_does(extra):
    """Was: no window at all (or a refusal with use_sliding_window) where transformers' GptOssConfig slides
    on the even layers, 128 tokens unless given."""
    from transformers import GptOssConfig

    config = dict(GPT_OSS, **extra)
    cfg = resolve_architecture(config)[1]
    hf = GptOssConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert [cfg.window_of(i) for i in range(cfg.num_layers)] == want


QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 36, "num_attention_heads": 2, "num_key_value_heads": 1}



@pytest.mark.parametrize("config, line", [
    (dict(QWEN2, use_sliding_window=True, sliding_window=4096, max_window_layers=28),
     "sliding window 4096 tokens on layers 28-35 (8 of 36), full causal on the others"),
    (dict(QWEN2, use_sliding_window=False, sliding_window=4096),
     "full causal on all 36 layers (config.json's sliding_window 4096 is off for Qwen2ForCausalLM"),
    (dict(QWEN2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True, sliding_window=64,
          layer_types=["full_attention"] * 2 + ["sliding_attention"] * 4 + ["full_attention"] * 30),
     "sliding window 64 tokens on layers 2-5 (4 of 36), full causal on the others"),
    (dict(GPT_OSS, num_hidden_layers=24),
     "sliding window 128 tokens on layers 0, 2, 4, ..., 22 (12 of 24), full causal on the others"),
    (dict(QWEN2, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096),
     "sliding window 4096 tokens on layers 0-35 (36 of 36), no full-attention layer"),
    (dict(QWEN2, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
     "full causal on all 36 layers"),
    (dict(QWEN2, architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=2047),  # Phi-3-mini-4k
     "sliding window 2047 tokens on layers 0-35 (36 of 36), no full-attention layer"),
    (dict(QWEN2, architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=4096),  # alternating
     "sliding window 4096 tokens on layers 0, 2, 4, ..., 34 (18 of 36), full causal on the others, attention logits "
     "soft-capped at 50, output logits soft-capped at 30"),
    (dict(QWEN2, architectures=["Gemma4ForCausalLM"], model_type="gemma4", sliding_window=4096),  # not served
     "config.json gives a sliding window of 4096 tokens"),
    (dict(QWEN2, architectures=["LlamaForCausalLM"], model_type="llama"), "full causal on all 36 layers"),
    (dict(QWEN2, architectures=["Llama4ForCausalLM"], model_type="llama4_text", num_local_experts=4,
          num_experts_per_tok=1, num_hidden_layers=8),  # Scout's layout: chunks on three layers in four
     "chunks of 8192 tokens on layers 0-2, 4-6 (6 of 8), full causal on the others"),
])
def test_inspect_shows_the_sliding_window_layout(config, line):
    """Was: "sliding window N on K layers" only when config.json listed layer_types, even where transformers
    (and radiance) switch the window off; nothing for Qwen's max_window_layers or gpt-oss's default."""
    from radiance.checkpoint.inspect import _attention_line

    assert _attention_line(config).startswith(line)


def test_inspect_prints_the_attention_line(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", arch="qwen2"))
    assert "attention  full causal on the one layer" in inspect_lines(ckpt)
