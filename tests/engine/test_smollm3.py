"""SmolLM3 (SmolLM3ForCausalLM) as transformers reads it: NoPE on the layers `no_rope_layers` zeroes (every fourth
without it), a window only with use_sliding_window, on the NoPE layers unless layer_types says otherwise."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers
from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf

SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
         "vocab_size": 100}


def _arch(**config):
    return resolve_architecture({"architectures": ["SmolLM3ForCausalLM"], **SIZES, **config})[1]


def test_config_as_transformers_reads_it():
    released = _arch(sliding_window=None, use_sliding_window=False)  # SmolLM3-3B's
    assert released.nope_layers == {3, 7} and released.sliding_layers == frozenset()
    assert released.tie_word_embeddings and released.rope_theta == 2_000_000.0 and released.num_kv_heads == 4
    listed = _arch(no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 1, 1])  # longer than the layers: transformers reads the first
    assert listed.nope_layers == {1, 4}
    sliding = _arch(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=16)
    assert sliding.nope_layers == {1, 3, 5, 7} and sliding.sliding_layers == {1, 3, 5, 7}
    types = ["sliding_attention"] * 2 + ["full_attention"] * 6
    typed = _arch(use_sliding_window=True, sliding_window=16, layer_types=types)
    assert typed.sliding_layers == {0, 1}
    assert resolve_architecture({"model_type": "smollm3", **SIZES})[0].__name__ == "SmolLM3ForCausalLM"


@pytest.mark.parametrize("config, refusal", [
    ({"no_rope_layers": [1, 0]}, "must list 0 or 1 for each of the 8 layers"),
    ({"no_rope_layers": [1, 2, 1, 1, 1, 1, 1, 1]}, "no_rope_layers"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_bad_settings_are_refused_in_one_line(config, refusal):
    with pytest.raises(ConfigError, match=refusal):
        _arch(**config)


def test_the_nope_layer_changes_the_logits(tiny_model_dir):
    """The same weights with every layer rotated give other logits, so the match with transformers depends on NoPE."""
    path, _ = tiny_model_dir("smollm3")
    ckpt = open_checkpoint(path)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(9))
    nope = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = dict(ckpt.config, no_rope_layers=[1, 1])
    rotated = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    a, b = nope.forward_logits(ids), rotated.forward_logits(ids)
    assert ((a - b).norm() / b.norm()).item() > 1e-2


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    """Through the paged KV cache: the NoPE layer stores unrotated keys, prefill whole or chunked, then decodes."""
    assert_engine_greedy_matches_transformers(*tiny_model_dir("smollm3"), prompt_len=36, chunk=chunk, low=3)


def test_a_smollm3_gguf_as_llama_cpp_writes_it(tmp_path):
    """llama.cpp's SmolLM3 file (Llama's converter: q / k rows permuted, no NoPE metadata, every 4th layer NoPE as
    llama.cpp takes it): transformers' logits for the same weights."""
    from transformers import AutoModelForCausalLM, SmolLM3Config

    config = SmolLM3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    write_gguf(tmp_path / "s.gguf", "smollm3", config, gguf_tensors(hf, LLAMA_BLOCK, permute=True))
    ckpt = open_checkpoint(str(tmp_path / "s.gguf"))
    assert resolve_architecture(ckpt.config)[1].nope_layers == {3}
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5
