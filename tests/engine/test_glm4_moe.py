"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM) as transformers computes it: q / k / v biases without an o_proj bias, q / k
norms, rotary on the leading half of each head, dense first layers, then sparse MLPs whose router picks by sigmoid
score plus a learned correction bias within the best expert groups (weights: the unbiased scores, renormalized and
scaled) and an ungated shared expert; the checkpoints' multi-token-prediction layer is not read."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.kernels.moe_routing import grouped_sigmoid_top_k
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers

# GLM-4.5-Air's config.json (zai-org/GLM-4.5-Air), as published
GLM_45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
              "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
              "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
              "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
              "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
              "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
              "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
              "use_qk_norm": False, "vocab_size": 151552}


def _forward(path_or_ckpt, ids, **options):
    ckpt = open_checkpoint(path_or_ckpt) if isinstance(path_or_ckpt, str) else path_or_ckpt
    config = ModelConfig(device="cpu", dtype=options.pop("dtype", "float32"), **options)
    return load_model(config, checkpoint=ckpt, progress=False).model.forward_logits(ids)


def test_glm_45_air_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(GLM_45_AIR)
    assert cls.__name__ == "Glm4MoeForCausalLM"
    assert cfg.head_dim == 128 and cfg.rotary_dim == 64 and cfg.rope_theta == 1e6
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and cfg.intermediate_size == 10944
    moe = cfg.moe
    assert moe.num_experts == 128 and moe.top_k == 8 and moe.intermediate_size == 1408 and moe.norm_topk_prob
    assert moe.layers == set(range(1, 46)) and moe.shared_expert_size == 1408 and not moe.shared_expert_gated
    assert moe.sigmoid_grouped and (moe.num_groups, moe.top_groups, moe.routed_scaling) == (1, 1, 1.0)
    glm45 = resolve_architecture(dict(GLM_45_AIR, n_routed_experts=160, first_k_dense_replace=3, use_qk_norm=True,
                                      routed_scaling_factor=2.5, n_shared_experts=2))[1]
    assert glm45.qk_norm and glm45.moe.layers == set(range(3, 46)) and glm45.moe.routed_scaling == 2.5
    assert glm45.moe.shared_expert_size == 2816
    # transformers' Glm4MoeConfig rotates half of each head when config.json gives no factor
    assert resolve_architecture({k: v for k, v in GLM_45_AIR.items() if k != "partial_rotary_factor"})[1].rotary_dim == 64


@pytest.mark.parametrize("change, message", [
    ({"n_group": 3}, "n_group=3 must divide the 128 experts"),
    ({"n_group": 4, "topk_group": 5}, "topk_group=5 of n_group=4"),
    ({"n_group": 64, "topk_group": 1, "num_experts_per_tok": 3}, "fewer than num_experts_per_tok=3"),
    ({"first_k_dense_replace": 47}, "first_k_dense_replace"),
    ({"first_k_dense_replace": "1"}, "first_k_dense_replace"),
    ({"n_shared_experts": -1}, "n_shared_experts"),
    ({"routed_scaling_factor": -1}, "routed_scaling_factor"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
])
def test_router_configs_radiance_cannot_serve_are_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve_architecture(dict(GLM_45_AIR, **change))


@pytest.mark.parametrize("groups, top_groups, renormalize", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_grouped_sigmoid_pick_is_transformers_router(groups, top_groups, renormalize):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
                           topk_group=top_groups, norm_topk_prob=renormalize, routed_scaling_factor=1.7)
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(16, generator=gen))
    x = torch.randn(50, 32, generator=gen)
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = grouped_sigmoid_top_k(logits, router.e_score_correction_bias, 4, groups, top_groups, renormalize,
                                         1.7)
    # transformers leaves the top k unsorted: compare each token's picks as sets, with their weights
    want_ids, order = want_ids.sort(dim=-1)
    got_ids, got_order = ids.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(weights.gather(1, got_order), want_weights.gather(1, order), rtol=1e-6, atol=1e-7)
    if groups > 1:  # the groups decide: picking over every expert would choose others for some tokens
        free = grouped_sigmoid_top_k(logits, router.e_score_correction_bias, 4, 1, 1, renormalize, 1.7)[1]
        assert not torch.equal(free.sort(dim=-1).values, got_ids)


def test_logits_match_transformers_and_depend_on_the_router(tiny_model_dir):
    """forward_logits equals transformers' within float32 rounding; without the correction bias, or with one group,
    the picks and so the logits change: the match depends on both."""
    path, hf = tiny_model_dir("glm4moe")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
    got = _forward(path, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ungrouped = open_checkpoint(path)
    ungrouped.config = dict(ungrouped.config, n_group=1, topk_group=1)
    assert ((_forward(ungrouped, ids) - got).norm() / got.norm()).item() > 1e-3
    unbiased = os.path.join(os.path.dirname(path), "glm-unbiased")
    _copy(path, unbiased, lambda name, t: torch.zeros_like(t) if name.endswith("e_score_correction_bias") else t)
    assert ((_forward(unbiased, ids) - got).norm() / got.norm()).item() > 1e-3


def _copy(path: str, out: str, change, extra: dict | None = None) -> None:
    tensors = {name: change(name, t) for name, t in load_file(os.path.join(path, "model.safetensors")).items()}
    os.makedirs(out, exist_ok=True)
    save_file(dict(tensors, **(extra or {})), os.path.join(out, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)


def test_the_multi_token_prediction_layer_is_not_read(tiny_model_dir, tmp_path, caplog):
    """GLM-4.5's checkpoints carry a layer past num_hidden_layers (its MTP module: eh_proj, enorm, hnorm, a decoder
    layer, shared_head): served without it, the same logits, and the log says what was left out."""
    path, _ = tiny_model_dir("glm4moe")
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.hnorm.weight": torch.ones(64), "model.layers.3.self_attn.q_proj.weight": torch.zeros(128, 64),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64),
           "model.layers.3.shared_head.norm.weight": torch.ones(64)}
    _copy(path, str(tmp_path / "mtp"), lambda name, t: t, extra=mtp)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with caplog.at_level("INFO", logger="radiance"):
        got = _forward(str(tmp_path / "mtp"), ids)
    assert torch.equal(got, _forward(path, ids))
    assert "6 tensors of the layers past num_hidden_layers=3" in caplog.text


def test_a_missing_correction_bias_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("glm4moe")
    out = str(tmp_path / "nobias")
    _copy(path, out, lambda name, t: t)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.2\.mlp\.gate\.e_score_correction_bias"):
        open_checkpoint(out)


@pytest.mark.parametrize("chunk", [None, 7])
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("glm4moe"), prompt_len=30, chunk=chunk)


def test_mxfp4_at_load_and_converted_on_disk_serve_the_same_logits(tiny_model_dir, tmp_path):
    """Every linear on MXFP4 at load: 3 x (qkv + o) + the dense MLP's 2 + 2 sparse layers x (8 experts + the shared
    one) x 2, the router in fp32 (bf16 model); and the same logits, bit for bit, from what `radiance convert` wrote."""
    path = str(tmp_path / "bf16")  # as GLM-4.5 ships: bf16, the correction bias fp32 (kept so by the conversion)
    _copy(tiny_model_dir("glm4moe")[0], path,
          lambda name, t: t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16))
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "linears: 44 mxfp4" in "\n".join(loaded.summary)
    gate = loaded.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    at_load = loaded.model.forward_logits(ids)
    convert_checkpoint(path, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    with safe_open(str(tmp_path / "mx" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
    assert torch.equal(at_load, _forward(str(tmp_path / "mx"), ids, dtype="bfloat16"))


# llama.cpp's names of a GLM-4.5 layer's modules (convert_hf_to_gguf.py's Glm4MoeModel)
GLM_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
             "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def test_a_glm4moe_gguf_as_llama_cpp_writes_it(tiny_model_dir, tmp_path, caplog):
    """llama.cpp's glm4moe file: block_count counting the multi-token-prediction layer (its tensors not read), the
    router's correction bias as exp_probs_b, the experts' sizes, groups and scaling as glm4moe.* metadata, half of
    each head rotating (rope.dimension_count), q / k rows as stored: transformers' logits."""
    from tests.engine.gguf_files import gguf_tensors, write_gguf

    _, hf = tiny_model_dir("glm4moe")
    c = hf.config
    tensors = gguf_tensors(hf, GLM_BLOCK)
    for i in (1, 2):
        tensors[f"blk.{i}.exp_probs_b.bias"] = tensors.pop(f"blk.{i}.ffn_gate_inp.e_score_correction_bias")
    tensors["blk.3.nextn.eh_proj.weight"] = torch.zeros(64, 128).numpy()  # the MTP layer: not read
    tensors["blk.3.attn_q.weight"] = torch.zeros(64, 64).numpy()
    metadata = {"glm4moe.expert_count": 8, "glm4moe.expert_used_count": 2, "glm4moe.expert_shared_count": 1,
                "glm4moe.expert_feed_forward_length": 32, "glm4moe.leading_dense_block_count": 1,
                "glm4moe.expert_weights_scale": 2.5, "glm4moe.expert_weights_norm": True,
                "glm4moe.expert_gating_func": 2, "glm4moe.expert_group_count": 4,
                "glm4moe.expert_group_used_count": 2, "glm4moe.nextn_predict_layers": 1,
                "glm4moe.rope.dimension_count": 8}
    c.num_hidden_layers = 4  # block_count: the three layers and the MTP one
    try:
        path = write_gguf(tmp_path / "glm.gguf", "glm4moe", c, tensors, metadata, head_dim=16)
    finally:
        c.num_hidden_layers = 3
    ckpt = open_checkpoint(path)
    cls, cfg = resolve_architecture(ckpt.config)
    assert cls.__name__ == "Glm4MoeForCausalLM" and cfg.num_layers == 3 and cfg.rotary_dim == 8
    assert cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias and cfg.moe.layers == {1, 2}
    assert (cfg.moe.num_groups, cfg.moe.top_groups, cfg.moe.routed_scaling) == (4, 2, 2.5)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
    with caplog.at_level("INFO", logger="radiance"):
        got = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model.forward_logits(ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert "2 tensors of the blocks past the model's 3 layers" in caplog.text
    softmax = write_gguf(tmp_path / "softmax.gguf", "glm4moe", c, tensors,
                         dict(metadata, **{"glm4moe.expert_gating_func": 1}), head_dim=16)
    with pytest.raises(Exception, match="expert_gating_func is 1"):
        open_checkpoint(softmax)
