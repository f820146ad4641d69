"""Gemma 3 (Gemma3ForCausalLM, and the language model of Gemma3ForConditionalGeneration) as transformers computes it:
sandwich norms scaling by 1 + weight, q/k norms, query_pre_attn_scalar, sliding layers with their own rope base,
GeGLU, scaled embeddings, a tied head; what radiance cannot serve refused in one line."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.kernels.glu import GELU_TANH
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers
from tests.engine.gguf_files import GEMMA_BLOCK, gguf_tensors, write_gguf

# the shape of gemma-3-4b-it's text_config as the Hub has it (the older rope keys, no layer_types)
HUB_STYLE = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "vocab_size": 100, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
             "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
             "sliding_window": 1024, "sliding_window_pattern": 6, "final_logit_softcapping": None,
             "attn_logit_softcapping": None}


def test_config_as_transformers_reads_it():
    cls, cfg = resolve_architecture(HUB_STYLE)
    assert cls.__name__ == "Gemma3ForCausalLM"
    assert cfg.sliding_window == 1024 and cfg.sliding_layers == {0, 1, 2, 3, 4, 6, 7, 8, 9, 10}  # every 6th is full
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling["factor"] == 8.0 and cfg.sliding_rope_theta == 10000.0
    assert cfg.attention_scale == 32 ** -0.5 and cfg.embed_scale == 8.0 and cfg.mlp_activation == GELU_TANH
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.max_position_embeddings == 131072  # Gemma's defaults
    layer_typed = resolve_architecture({**HUB_STYLE, "layer_types": ["full_attention"] * 11 + ["sliding_attention"]})[1]
    assert layer_typed.sliding_layers == {11}
    assert resolve_architecture({**HUB_STYLE, "architectures": None})[0].__name__ == "Gemma3ForCausalLM"


@pytest.mark.parametrize("change, refusal", [
    ({"final_logit_softcapping": -3.0}, "final_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),  # EmbeddingGemma
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"rope_local_base_freq": -1}, "positive"),
])
def test_what_radiance_cannot_serve_is_refused_in_one_line(change, refusal):
    with pytest.raises(ConfigError, match=refusal):
        resolve_architecture({**HUB_STYLE, **change})


@pytest.mark.parametrize("change", [
    {"attention_bias": True},
    {"final_logit_softcapping": 3.0},
    {"attn_logit_softcapping": 2.0},  # kept by transformers' Gemma 3 config, never applied by its attention
], ids=["attention_bias", "final_softcap", "attn_softcap"])
def test_what_transformers_gemma3_serves_beyond_the_published_configs(tmp_path, change):
    """Were refused: an attention bias ("tensor not used by the model (... o_proj.bias)") and the soft caps
    ("Gemma 3 has no soft-capped logits"), which transformers' Gemma 3 reads."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from tests.engine.conftest import randomize

    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16, **change)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(tmp_path)),
                      progress=False).model.forward_logits(ids)
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-5


def test_each_piece_is_applied(tiny_model_dir):
    """The 1 + weight norms, the query scale and the sliding layers' own rope base each change the logits, so the
    exact match with transformers (test_models.test_logits_match_transformers) depends on all of them."""
    path, hf = tiny_model_dir("gemma3")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    ckpt = open_checkpoint(path)
    base = dict(ckpt.config)
    for change in ({"query_pre_attn_scalar": 32},
                   {"rope_parameters": {**base["rope_parameters"], "sliding_attention": {"rope_type": "default",
                                                                                         "rope_theta": 1e6}}}):
        ckpt.config = {**base, **change}
        model = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
        assert ((model.forward_logits(ids) - ref).norm() / ref.norm()).item() > 1e-2, change
    ckpt.config = base
    model = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert torch.equal(model.forward_logits(ids), model.forward_logits(ids))
    assert ((model.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5


def test_bf16_stays_near_transformers(tiny_model_dir):
    """In bf16 the norms round as transformers' (1 + weight applied in fp32, one rounding); the rotary (fp32 here,
    bf16 products there) and the sliding-window attention (fp32 here) still differ: the logits stay within bf16's own
    distance from fp32."""
    from transformers import AutoModelForCausalLM

    path, hf = tiny_model_dir("gemma3")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(4))
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # the fixture's model stays fp32
    with torch.no_grad():
        ref32 = hf(ids).logits
        ref16 = hf16(ids).logits.float()
    ours = load_model(ModelConfig(device="cpu", dtype="bfloat16"), checkpoint=open_checkpoint(path),
                      progress=False).model.forward_logits(ids).float()
    theirs, mine = (((x - ref32).norm() / ref32.norm()).item() for x in (ref16, ours))
    assert mine <= 2 * theirs + 1e-3, (mine, theirs)


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("gemma3"), prompt_len=40, chunk=chunk)


def test_the_language_model_of_gemma3_for_conditional_generation(tmp_path):
    """gemma-3-4b and up ship as Gemma3ForConditionalGeneration: its language model is served from the same files,
    the SigLIP tower and projector skipped, with transformers' logits for text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=300, head_dim=32, sliding_window=24,
                            query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                          boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.architecture == "Gemma3ForCausalLM" and ckpt.tie_word_embeddings
    ids = torch.randint(0, 296, (1, 60), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5


def gguf_of(hf, path, window_pattern: int | None = None) -> str:
    """The tiny model as llama.cpp's converter writes a Gemma 3 GGUF: its tensor names, every norm weight stored as
    1 + weight, the global rope base and linear scaling in the metadata, the local base and window pattern left to
    llama.cpp's defaults (10000, 6) unless `window_pattern` is written."""
    c = hf.config
    full = c.rope_parameters["full_attention"]
    metadata = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": float(full["factor"]),
                "gemma3.attention.sliding_window": c.sliding_window,
                "gemma3.attention.scale": c.query_pre_attn_scalar ** -0.5}
    if window_pattern is not None:
        metadata["gemma3.attention.sliding_window_pattern"] = window_pattern
    block = {**GEMMA_BLOCK, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    return write_gguf(path, "gemma3", c, gguf_tensors(hf, block, norm_shift=1.0), metadata, head_dim=c.head_dim,
                      rope_theta=full["rope_theta"])


def test_a_gemma3_gguf_as_llama_cpp_writes_it(tiny_model_dir, tmp_path):
    """llama.cpp's Gemma 3 file: its norms' 1 + weight taken back to transformers' weight, ffn_norm read as the norm
    before the MLP and the two post norms placed, the query scale from attention.scale: transformers' logits. Without
    a window pattern in the metadata llama.cpp's 6 applies (full attention on layer 5 only; the tiny model's 2 layers
    then both slide), with one written it is read."""
    path, hf = tiny_model_dir("gemma3")
    ckpt = open_checkpoint(gguf_of(hf, tmp_path / "g.gguf", window_pattern=2))
    assert ckpt.architecture == "Gemma3ForCausalLM" and ckpt.tie_word_embeddings
    _, cfg = resolve_architecture(ckpt.config)
    assert cfg.sliding_layers == {0} and cfg.sliding_rope_theta == 10000.0 and cfg.rope_scaling["factor"] == 8.0
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5
    default = open_checkpoint(gguf_of(hf, tmp_path / "d.gguf"))
    assert resolve_architecture(default.config)[1].sliding_layers == {0, 1}
