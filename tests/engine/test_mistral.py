"""Mistral (MistralForCausalLM) as transformers reads it: the Llama decoder without biases and a sliding window on
every layer when config.json gives one (4096 when absent, none when null)."""

from __future__ import annotations

import pytest
import torch

from radiance import LLM, SamplingParams
from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.models.registry import resolve_architecture

SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 16,
         "vocab_size": 100}


def _arch(**config):
    return resolve_architecture({"architectures": ["MistralForCausalLM"], **SIZES, **config})[1]


def test_a_window_on_every_layer_as_transformers_reads_it():
    absent = _arch()
    assert absent.sliding_window == 4096 and absent.sliding_layers == {0, 1, 2}  # MistralConfig's default
    assert absent.num_kv_heads == 8 and absent.head_dim == 4  # MistralConfig: 8 KV heads, hidden / heads
    assert _arch(sliding_window=None).sliding_layers == frozenset()  # v0.2 on: full attention
    # transformers' Mistral reads neither layer_types nor attention_bias
    ignored = _arch(sliding_window=8, layer_types=["full_attention"] * 3, attention_bias=True, num_key_value_heads=2)
    assert ignored.sliding_window == 8 and ignored.sliding_layers == {0, 1, 2}
    assert not ignored.qkv_bias and not ignored.o_bias
    by_type = resolve_architecture({"model_type": "mistral", **SIZES, "num_key_value_heads": 2})
    assert by_type[0].__name__ == "MistralForCausalLM" and by_type[1].max_position_embeddings == 131072


def test_the_window_is_applied(tiny_model_dir):
    """The same weights without the window give other logits past it: the match with transformers
    (test_models.test_logits_match_transformers) depends on the window."""
    path, _ = tiny_model_dir("mistral")
    ckpt = open_checkpoint(path)
    windowed = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = dict(ckpt.config, sliding_window=None)
    full = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    a, b = windowed.forward_logits(ids), full.forward_logits(ids)
    assert torch.equal(a[:, :24], b[:, :24])  # inside the window both attend to everything
    assert ((a[:, 24:] - b[:, 24:]).norm() / b[:, 24:].norm()).item() > 1e-2


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers_past_the_window(tiny_model_dir, chunk):
    """Paged prefill (whole or chunked) and decode through the window give transformers' greedy tokens."""
    path, hf = tiny_model_dir("mistral")
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(path, device="cpu", dtype="float32", **options)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref[0, 40:].tolist()
