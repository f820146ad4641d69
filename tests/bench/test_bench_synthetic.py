import pytest
import torch

from radiance.bench.synthetic import SyntheticCheckpoint, is_synthetic, synthetic_config
from radiance.errors import ConfigError
from radiance.formats import Mxfp4Weight, Nvfp4Weight, dequantize

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}


@pytest.mark.parametrize("name, expected", [
    ("llama-3.1-8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                          max_position_embeddings=131072, tie_word_embeddings=False)),
    ("qwen3-8b", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000, rms_norm_eps=1e-6,
                      max_position_embeddings=40960, tie_word_embeddings=False)),
    ("qwen3-32b", dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_word_embeddings=False)),
    ("qwen3-30b-a3b", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                           num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           mlp_only_layers=[], decoder_sparse_step=1, tie_word_embeddings=False)),
    ("gemma-3-12b", dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, vocab_size=262208,
                         sliding_window=1024, rope_theta=1000000.0, tie_word_embeddings=True)),
    ("gemma-3-27b", dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, vocab_size=262208,
                         sliding_window=1024, rope_theta=1000000.0, tie_word_embeddings=True)),
    ("gpt-oss-20b", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32,
                         num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0, rope_theta=150000,
                         tie_word_embeddings=False)),
    ("llama-4-scout-17b-16e", dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                                   num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                   vocab_size=202048, num_local_experts=16, num_experts_per_tok=1,
                                   attention_chunk_size=8192, rope_theta=500000.0, tie_word_embeddings=False)),
])
def test_public_configs(name, expected):
    # values copied by hand from the models' published config.json files
    config = synthetic_config("synthetic:" + name)
    assert {k: config[k] for k in expected} == expected


def test_llama_rope_scaling_and_parameter_count():
    config = synthetic_config("llama-3.1-8b")
    assert config["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    # Llama-3.1-8B has 8,030,261,248 parameters (its published size)
    assert SyntheticCheckpoint("synthetic:llama-3.1-8b", device="cpu").num_parameters() == 8_030_261_248
    # Qwen3-32B: 32.8B by its model card
    assert 32.7e9 < SyntheticCheckpoint("synthetic:qwen3-32b", device="cpu").num_parameters() < 32.9e9
    # Qwen3-30B-A3B: 30.5B in all by its model card
    assert 30.4e9 < SyntheticCheckpoint("synthetic:qwen3-30b-a3b", device="cpu").num_parameters() < 30.6e9
    # Gemma 3's language models: 27.0B of the 27B (27.4B with the vision tower), 11.8B of the 12B (12.2B with it)
    assert 26.9e9 < SyntheticCheckpoint("synthetic:gemma-3-27b", device="cpu").num_parameters() < 27.1e9
    assert 11.7e9 < SyntheticCheckpoint("synthetic:gemma-3-12b", device="cpu").num_parameters() < 11.85e9
    # gpt-oss-20b: 21B (20.91B) by its model card
    assert 20.85e9 < SyntheticCheckpoint("synthetic:gpt-oss-20b", device="cpu").num_parameters() < 20.95e9


def test_gpt_oss_layers_carry_biases_sinks_and_a_biased_router():
    tiny = dict(TINY, num_local_experts=4, layer_types=["sliding_attention", "full_attention"])
    ckpt = SyntheticCheckpoint("synthetic:gpt-oss-20b", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    assert weights["model.layers.1.mlp.router.bias"].shape == (4,)
    assert weights["model.layers.1.self_attn.sinks"].shape == (4,)
    assert weights["model.layers.0.self_attn.o_proj.bias"].shape == (64,)
    assert weights["model.layers.0.self_attn.qkv_proj.bias"].shape == (64 + 2 * 32,)
    assert weights["model.layers.0.mlp.experts.3.gate_up_proj"].shape == (192, 64)
    assert weights["model.layers.0.mlp.experts.3.gate_up_proj.bias"].shape == (192,)
    assert weights["model.layers.0.mlp.experts.3.down_proj.bias"].shape == (64,)


def test_llama4_layers_carry_a_shared_expert_and_dense_mlps_of_their_own_size():
    tiny = dict(TINY, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4, interleave_moe_layer_step=2)
    ckpt = SyntheticCheckpoint("synthetic:llama-4-scout-17b-16e", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    assert weights["model.layers.0.mlp.gate_up_proj"].partition_sizes == (48, 48)  # dense: intermediate_size_mlp
    assert weights["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert weights["model.layers.1.mlp.experts.3.gate_up_proj"].partition_sizes == (32, 32)
    assert weights["model.layers.1.mlp.shared_expert.down_proj"].shape == (64, 32)
    assert not any("shared_expert_gate" in n or "q_norm" in n for n in weights)  # ungated; weightless head norms
    # Llama-4-Scout-17B-16E: 109B with its vision tower, 107.8B of them the language model's
    assert 107.7e9 < SyntheticCheckpoint("synthetic:llama-4-scout-17b-16e", device="cpu").num_parameters() < 107.8e9


def test_moe_layers_have_router_and_experts():
    tiny = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    ckpt = SyntheticCheckpoint("synthetic:qwen3-30b-a3b", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    assert weights["model.layers.0.mlp.gate.weight"].shape == (4, 64)
    assert weights["model.layers.0.mlp.experts.3.gate_up_proj"].partition_sizes == (32, 32)
    assert weights["model.layers.0.mlp.experts.3.down_proj"].shape == (64, 32)
    assert not any(n.startswith("model.layers.0.mlp.gate_up") for n in weights)
    assert weights["model.layers.1.mlp.gate_up_proj"].partition_sizes == (96, 96)  # the dense layer


def test_unknown_name_and_format():
    assert is_synthetic("synthetic:qwen3-8b") and not is_synthetic("/models/x") and not is_synthetic(None)
    with pytest.raises(ConfigError, match="synthetic:llama-3.1-8b"):
        synthetic_config("synthetic:llama-9")
    with pytest.raises(ConfigError):
        SyntheticCheckpoint("qwen3-8b", device="cpu", weight_format="int4")


def test_weights_have_canonical_names_and_shapes():
    ckpt = SyntheticCheckpoint("synthetic:qwen3-8b", device="cpu", dtype=torch.float32, overrides=TINY)
    assert ckpt.tokenizer() is None and ckpt.chat_template is None and ckpt.eos_token_ids == []
    weights = dict(ckpt.iter_weights(progress=False))
    assert list(weights) == ckpt.names()
    qkv = weights["model.layers.1.self_attn.qkv_proj"]
    assert qkv.format == "dense" and qkv.shape == (64 + 2 * 32, 64) and qkv.partition_sizes == (64, 32, 32)
    assert weights["model.layers.0.mlp.gate_up_proj"].partition_sizes == (96, 96)
    assert weights["model.layers.0.mlp.down_proj"].shape == (64, 96)
    assert weights["model.layers.0.self_attn.o_proj"].shape == (64, 64)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert torch.all(weights["model.norm.weight"] == 1)
    assert weights["model.embed_tokens.weight"].shape == (100, 64)
    assert weights["lm_head.weight"].shape == (100, 64)
    std = weights["model.embed_tokens.weight"].std().item()
    assert 0.015 < std < 0.025
    # Llama has no q/k norm
    llama = SyntheticCheckpoint("llama-3.1-8b", device="cpu", overrides=TINY)
    assert not any("q_norm" in n for n in llama.names())
    # same seed, same weights
    again = dict(SyntheticCheckpoint("synthetic:qwen3-8b", device="cpu", dtype=torch.float32,
                                     overrides=TINY).iter_weights(progress=False))
    assert torch.equal(again["model.layers.1.mlp.down_proj"].tensor, weights["model.layers.1.mlp.down_proj"].tensor)


@pytest.mark.parametrize("fmt, cls", [("mxfp4", Mxfp4Weight), ("nvfp4", Nvfp4Weight)])
def test_quantized_weight_formats(fmt, cls):
    dense = dict(SyntheticCheckpoint("llama-3.1-8b", device="cpu", dtype=torch.float32, overrides=TINY)
                 .iter_weights(progress=False))
    quant = dict(SyntheticCheckpoint("llama-3.1-8b", device="cpu", dtype=torch.float32, overrides=TINY,
                                     weight_format=fmt).iter_weights(progress=False))
    w = quant["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(w, cls) and w.partition_sizes == (64, 32, 32)
    ref = dense["model.layers.0.self_attn.qkv_proj"].tensor
    rel = ((dequantize(w) - ref).norm() / ref.norm()).item()
    assert 0.02 < rel < 0.2  # 4-bit rounding of the same random values
    assert torch.equal(quant["model.norm.weight"], dense["model.norm.weight"])


def test_gemma3_builds_as_its_model_class():
    """The synthetic Gemma 3 carries the tensors Gemma3ForCausalLM loads: its four norms, q/k norms, a tied head."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    tiny = dict(TINY, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=8)
    ckpt = SyntheticCheckpoint("synthetic:gemma-3-27b", device="cpu", dtype=torch.float32, overrides=tiny)
    assert "model.layers.0.pre_feedforward_layernorm.weight" in ckpt.names() and "lm_head.weight" not in ckpt.names()
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False)
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    assert loaded.model.config.sliding_layers == {0, 1, 2, 3, 4}  # every 6th layer attends to everything
    assert torch.isfinite(loaded.model.forward_logits(torch.arange(20)[None])).all()


def test_glm_layers_carry_a_dense_first_mlp_a_corrected_router_and_a_shared_expert():
    tiny = dict(TINY, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
    ckpt = SyntheticCheckpoint("synthetic:glm-4.5-air", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    assert weights["model.layers.0.mlp.gate_up_proj"].partition_sizes == (96, 96)  # first_k_dense_replace 1
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (4,)
    assert weights["model.layers.1.mlp.shared_expert.down_proj"].shape == (64, 32)
    assert weights["model.layers.1.self_attn.qkv_proj.bias"].shape == (64 + 2 * 32,)
    assert not any("o_proj.bias" in n or "shared_expert_gate" in n or "q_norm" in n for n in weights)
    # GLM-4.5-Air: "106B total parameters" by its model card (the multi-token-prediction layer not counted)
    assert 106.8e9 < SyntheticCheckpoint("synthetic:glm-4.5-air", device="cpu").num_parameters() < 106.9e9


def test_qwen3_5_alternates_linear_attention_and_gated_attention_layers():
    """Three Gated DeltaNet layers to one gated attention layer, loaded and run."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    tiny = dict(TINY, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=300)
    ckpt = SyntheticCheckpoint("synthetic:qwen3.5-9b", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    # q | k | v and z, b and a: the checkpoint's four projections served as two linears
    assert weights["model.layers.0.linear_attn.in_proj_qkvz"].partition_sizes == (2 * 2 * 16 + 4 * 8, 4 * 8)
    assert weights["model.layers.0.linear_attn.in_proj_ba"].partition_sizes == (4, 4)
    assert weights["model.layers.0.linear_attn.conv1d.weight"].shape == (96, 1, 4)
    assert weights["model.layers.3.self_attn.qkv_proj"].partition_sizes == (2 * 64, 32, 32)  # q and its gate
    assert "model.layers.0.self_attn.qkv_proj" not in weights and "model.layers.3.linear_attn.A_log" not in weights
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False)
    assert loaded.model.config.linear_layers == {0, 1, 2}
    assert torch.isfinite(loaded.model.forward_logits(torch.arange(20)[None])).all()
    # transformers' defaults (hidden 4096, 32 layers, vocab 248320): about 9B parameters
    assert 8.5e9 < SyntheticCheckpoint("synthetic:qwen3.5-9b", device="cpu").num_parameters() < 10e9


def test_qwen3_next_builds_grouped_projections_and_sparse_mlps():
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    tiny = dict(TINY, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=300,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    ckpt = SyntheticCheckpoint("synthetic:qwen3-next-80b-a3b", device="cpu", dtype=torch.float32, overrides=tiny)
    weights = dict(ckpt.iter_weights(progress=False))
    assert weights["model.layers.0.linear_attn.in_proj_qkvz"].shape == (96 + 32, 64)
    assert weights["model.layers.0.linear_attn.in_proj_ba"].shape == (8, 64)
    assert weights["model.layers.3.mlp.shared_expert_gate.weight"].shape == (1, 64)
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False)
    assert torch.isfinite(loaded.model.forward_logits(torch.arange(20)[None])).all()
    # Qwen3-Next-80B-A3B: "80B total parameters" by its model card (the MTP layer not built)
    assert 79e9 < SyntheticCheckpoint("synthetic:qwen3-next-80b-a3b", device="cpu").num_parameters() < 82e9
