"""Which launches release their PDL dependents early (triton_support.PDL_EARLY_RELEASE): the dense quantize after
gate_up only (bench/RESULTS.md, thirty-fourth session: the same release before an expert GEMM cost gpt-oss-20b
200 us per step), never without PDL, and a misspelt launch name fails loudly instead of silently never releasing."""

from types import SimpleNamespace

import pytest
import torch

import radiance.kernels.activation as activation
import radiance.kernels.triton_support as triton_support


def test_production_releases_the_dense_quantize_only():
    assert triton_support.releases_early("parts_quantize", pdl=True)
    assert not triton_support.releases_early("moe_parts_quantize", pdl=True)
    assert not any(triton_support.releases_early(norm, pdl=True) for norm in ("attn_norm", "mlp_norm", "norm"))


@pytest.mark.parametrize("launch", triton_support.EARLY_RELEASE_LAUNCHES)
def test_no_release_without_pdl(launch, monkeypatch):
    monkeypatch.setattr(triton_support, "PDL_EARLY_RELEASE", frozenset(triton_support.EARLY_RELEASE_LAUNCHES))
    assert not triton_support.releases_early(launch, pdl=False)
    assert triton_support.releases_early(launch, pdl=True)


def test_the_layer_norms_are_named_apart():
    from radiance.layers.rotary import RotaryEmbedding
    from radiance.models.arch_config import ArchConfig
    from radiance.models.llama import LlamaDecoderLayer

    cfg = ArchConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False)
    layer = LlamaDecoderLayer(cfg, RotaryEmbedding(16, 128, 10000.0), 0)
    assert (layer.input_layernorm.launch, layer.post_attention_layernorm.launch) == ("attn_norm", "mlp_norm")
    assert all(name in triton_support.EARLY_RELEASE_LAUNCHES
               for name in (layer.input_layernorm.launch, layer.post_attention_layernorm.launch))


@pytest.mark.parametrize("m, launch", [(1, "parts_quantize"), (64, "parts_quantize"), (65, "prefill_parts_quantize")])
def test_the_glu_quantize_is_named_by_the_decode_band(m, launch, monkeypatch):
    """Only a decode-band down GEMM (a grid that fits the SMs at once) was measured to gain from the release."""
    from radiance.kernels import w4a8

    seen = []
    monkeypatch.setattr(w4a8, "glu_epilogue_serves", lambda n, k, device: True)
    monkeypatch.setattr(w4a8, "_expand_serves", lambda *args: False)
    monkeypatch.setattr(w4a8, "_launch", lambda x_q, *args, **kwargs: (
        torch.zeros(x_q.shape[0], 8), None, torch.zeros(x_q.shape[0], 1, dtype=torch.int32)))
    monkeypatch.setattr(w4a8, "quantize_rows_from_parts", lambda y, amax, launch: seen.append(launch) or (y, amax))
    w4a8.w4a8_glu(torch.zeros(m, 64), torch.ones(m, 1), SimpleNamespace(shape=(16, 64)), decode_band=64)
    assert seen == [launch]


def test_an_unknown_launch_name_is_an_error():
    y = torch.zeros((1, 64))
    amax = torch.zeros((1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="moe_parts_quantise"):
        activation.quantize_rows_from_parts(y, amax, launch="moe_parts_quantise")
