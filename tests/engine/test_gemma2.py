"""Gemma 2 (Gemma2ForCausalLM) as transformers computes it: Gemma 3's layers without q / k norms, sliding and full
layers alternating with one rope, and the soft-capped attention and output logits (c * tanh(x / c))."""

from __future__ import annotations

import re

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers
from tests.engine.gguf_files import GEMMA_BLOCK, gguf_tensors, write_gguf

SIZES = {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
         "num_attention_heads": 8, "vocab_size": 256000}  # gemma-2-2b's sizes


def test_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(SIZES)
    assert cls.__name__ == "Gemma2ForCausalLM"
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)  # Gemma2Config's defaults
    assert cfg.sliding_window == 4096 and cfg.sliding_layers == set(range(0, 26, 2))  # even layers slide
    assert not cfg.qk_norm and cfg.sliding_rope_theta is None and cfg.rope_theta == 10000.0
    assert cfg.head_dim == 256 and cfg.num_kv_heads == 4 and cfg.tie_word_embeddings
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embed_scale == 2304 ** 0.5
    uncapped = resolve_architecture(dict(SIZES, attn_logit_softcapping=None, final_logit_softcapping=None))[1]
    assert uncapped.attn_softcap is None and uncapped.final_softcap is None
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        resolve_architecture(dict(SIZES, attn_logit_softcapping=-1.0))


def test_inspect_names_the_caps(tiny_model_dir):
    from radiance.checkpoint.inspect import inspect_lines

    lines = inspect_lines(open_checkpoint(tiny_model_dir("gemma2")[0]))
    assert ("attention  sliding window 24 tokens on layers 0 (1 of 2), full causal on the others, attention logits "
            "soft-capped at 2, output logits soft-capped at 3") in lines


def test_inspect_columns_stay_aligned_past_long_norm_names(tiny_model_dir):
    """Gemma 2's `model.layers.*.pre_feedforward_layernorm.weight` (48 characters) pushed its row's count, dtype
    and shape one column right of the header's."""
    from radiance.checkpoint.inspect import inspect_lines

    lines = inspect_lines(open_checkpoint(tiny_model_dir("gemma2")[0]))
    start = lines.index("other tensors") + 1
    rows = lines[start:lines.index("", start)]
    assert any("pre_feedforward_layernorm" in row for row in rows)
    for column in ("count", "dtype", "shape", "bytes"):
        # right-aligned columns end where the header's word ends, left-aligned ones start where it starts
        at = rows[0].index(column) + (len(column) if column in ("count", "bytes") else 0)
        for row in rows[1:]:
            fields = [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)?", row)]
            if column in ("count", "bytes"):
                assert any(end == at for _, end in fields), (column, row)
            else:
                assert any(begin == at for begin, _ in fields), (column, row)


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("gemma2"), prompt_len=36, chunk=chunk)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_soft_cap_changes_the_logits(tiny_model_dir, cap):
    """The same weights without one of the caps give other logits, so the match with transformers depends on both."""
    path, _ = tiny_model_dir("gemma2")
    ckpt = open_checkpoint(path)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(8))
    capped = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = dict(ckpt.config, **{cap: None})
    uncapped = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    a, b = capped.forward_logits(ids), uncapped.forward_logits(ids)
    assert ((a - b).norm() / b.norm()).item() > 1e-2
    if cap == "final_logit_softcapping":
        assert a.abs().max().item() < 3.0  # the cap bounds every logit


def test_a_gemma2_gguf_as_llama_cpp_writes_it(tmp_path):
    """llama.cpp's Gemma 2 file: norms stored as 1 + weight, ffn_norm the norm before the MLP, the soft caps and
    window in the metadata, the query scale llama.cpp computes from head_dim: transformers' logits."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, head_dim=32, query_pre_attn_scalar=32,
                          sliding_window=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                          max_position_embeddings=512)
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    metadata = {"gemma2.attention.sliding_window": 24, "gemma2.attn_logit_softcapping": 2.0,
                "gemma2.final_logit_softcapping": 3.0}
    write_gguf(tmp_path / "g2.gguf", "gemma2", config, gguf_tensors(hf, GEMMA_BLOCK, norm_shift=1.0), metadata,
               head_dim=32)
    ckpt = open_checkpoint(str(tmp_path / "g2.gguf"))
    cfg = resolve_architecture(ckpt.config)[1]
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_layers) == (2.0, 3.0, {0})
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5
