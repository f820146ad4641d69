"""Mistral (MistralForCausalLM) as transformers reads it: the Llama decoder without biases and a sliding window on
every layer when config.json gives one (4096 when absent, none when null)."""

from __future__ import annotations

import pytest

from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers, assert_window_changes_logits

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
    assert_window_changes_logits(tiny_model_dir("mistral")[0], window=24, tokens=60)


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers_past_the_window(tiny_model_dir, chunk):
    """Paged prefill (whole or chunked) and decode through the window give transformers' greedy tokens."""
    assert_engine_greedy_matches_transformers(*tiny_model_dir("mistral"), prompt_len=40, chunk=chunk)
