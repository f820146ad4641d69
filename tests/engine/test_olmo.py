"""OLMo 2 (Olmo2ForCausalLM) as transformers computes it: norms after the attention and the MLP only, q and k normed
over all their heads at once; served through the paged cache and, from GGUF, as llama.cpp writes it. OLMo 3
(Olmo3ForCausalLM): the same layers, three sliding to one full, each kind with its own rope; from GGUF, llama.cpp's
olmo2 file with a window."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from radiance.models.registry import resolve_architecture
from tests.engine.conftest import assert_engine_greedy_matches_transformers
from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf


def test_resolved_from_model_type_with_transformers_defaults():
    cls, cfg = resolve_architecture({"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 96,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})
    assert cls.__name__ == "Olmo2ForCausalLM"
    assert cfg.max_position_embeddings == 2048 and cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("chunk", [None, 16])
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("olmo2"), prompt_len=30, chunk=chunk)


def test_a_checkpoint_without_its_output_norms_names_the_tensor(tiny_model_dir, tmp_path):
    """The layer's norms are the two output norms (no input norm to ask for): one missing is named at open."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = tiny_model_dir("olmo2")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(f"{broken}/model.safetensors")
    del tensors["model.layers.1.post_feedforward_layernorm.weight"]
    save_file(tensors, f"{broken}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.post_feedforward_layernorm.weight"):
        load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(broken)), progress=False)


def test_an_olmo2_gguf_as_llama_cpp_writes_it(tiny_model_dir, tmp_path):
    """llama.cpp's OLMo 2 file (its own converter: q / k rows as stored, whole-width attn_q_norm / attn_k_norm,
    post_attention_norm and post_ffw_norm): transformers' logits for the same weights."""
    _, hf = tiny_model_dir("olmo2")
    block = {**LLAMA_BLOCK, "post_attention_layernorm": "post_attention_norm",
             "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}
    write_gguf(tmp_path / "o.gguf", "olmo2", hf.config, gguf_tensors(hf, block))
    ckpt = open_checkpoint(str(tmp_path / "o.gguf"))
    assert ckpt.architecture == "Olmo2ForCausalLM"
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5


def test_olmo3_config_as_transformers_reads_it():
    sizes = {"model_type": "olmo3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
             "num_attention_heads": 4, "vocab_size": 100}
    cls, cfg = resolve_architecture(sizes)
    assert cls.__name__ == "Olmo3ForCausalLM"
    assert cfg.sliding_window == 4096 and cfg.sliding_layers == {0, 1, 2, 4, 5, 6}  # full on every fourth
    assert cfg.rope_theta == 500000.0 and cfg.sliding_rope_theta == 500000.0
    # an older config.json: its rope_theta and YaRN for the full layers; the sliding ones keep Olmo3Config's base
    _, old = resolve_architecture(dict(sizes, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}))
    assert old.rope_theta == 10000.0 and old.rope_scaling["factor"] == 8.0 and old.sliding_rope_theta == 500000.0
    assert old.context_length == 65536


@pytest.mark.parametrize("chunk", [None, 16])  # one prefill, or chunks smaller than the window
def test_olmo3_engine_greedy_tokens_match_transformers(tiny_model_dir, chunk):
    assert_engine_greedy_matches_transformers(*tiny_model_dir("olmo3"), prompt_len=40, chunk=chunk)


def test_olmo3_sliding_layers_rotate_with_their_own_base(tiny_model_dir):
    """The sliding layer's rope base changes the logits, so the match above depends on each kind's own rope."""
    path, _ = tiny_model_dir("olmo3")
    ckpt = open_checkpoint(path)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    own = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    rope = dict(ckpt.config["rope_parameters"], sliding_attention={"rope_type": "default", "rope_theta": 99.0})
    ckpt.config = dict(ckpt.config, rope_parameters=rope)
    other = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    a, b = own.forward_logits(ids), other.forward_logits(ids)
    assert ((a - b).norm() / b.norm()).item() > 1e-2


OLMO3_BLOCK = {**LLAMA_BLOCK, "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}
# the tiny olmo3 model's full layers' YaRN (tests/engine/conftest.py) as llama.cpp's converter writes it
OLMO3_YARN = {"olmo2.rope.scaling.type": "yarn", "olmo2.rope.scaling.factor": 8.0,
              "olmo2.rope.scaling.original_context_length": 64, "olmo2.rope.scaling.yarn_beta_fast": 32.0,
              "olmo2.rope.scaling.yarn_beta_slow": 1.0}


def _olmo3_gguf(path, hf, **metadata) -> str:
    return write_gguf(path, "olmo2", hf.config, gguf_tensors(hf, OLMO3_BLOCK), rope_theta=150000.0,
                      metadata={"olmo2.attention.sliding_window": 24, **OLMO3_YARN, **metadata})


@pytest.mark.parametrize("pattern", [[True, False], 2])  # one bool per layer (the converter's), or a period
def test_an_olmo3_gguf_as_llama_cpp_writes_it(tiny_model_dir, tmp_path, pattern):
    """llama.cpp's OLMo 3 file is an olmo2 file with a window: the pattern says which layers slide, the sliding ones
    rotate with rope.freq_base_swa's plain rope, the full ones with the file's YaRN: transformers' logits."""
    _, hf = tiny_model_dir("olmo3")
    ckpt = open_checkpoint(_olmo3_gguf(tmp_path / "o.gguf", hf, **{
        "olmo2.attention.sliding_window_pattern": pattern, "olmo2.rope.freq_base_swa": 10000.0}))
    assert ckpt.architecture == "Olmo3ForCausalLM"
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(7))  # past the 24-token window
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= 1e-5


def test_an_olmo3_gguf_without_pattern_or_local_base_takes_llama_cpps_defaults(tiny_model_dir, tmp_path):
    """No pattern: three sliding layers to one full (both of the tiny model's two layers slide); no freq_base_swa:
    the sliding layers rotate with rope.freq_base, unscaled. The converter's yarn_attn_factor (config.json's
    attention_factor) is YaRN's attention factor."""
    _, hf = tiny_model_dir("olmo3")
    ckpt = open_checkpoint(_olmo3_gguf(tmp_path / "o.gguf", hf, **{"olmo2.rope.scaling.yarn_attn_factor": 1.5}))
    cfg = resolve_architecture(ckpt.config)[1]
    assert cfg.sliding_window == 24 and cfg.sliding_layers == {0, 1}
    assert cfg.sliding_rope_theta == 150000.0 and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_scaling["attention_factor"] == 1.5


def test_an_olmo3_gguf_whose_pattern_misses_layers_names_the_file(tiny_model_dir, tmp_path):
    _, hf = tiny_model_dir("olmo3")
    path = _olmo3_gguf(tmp_path / "o.gguf", hf, **{"olmo2.attention.sliding_window_pattern": [True, False, True]})
    with pytest.raises(CheckpointError, match=r"sliding_window_pattern lists 3 layers of 2.*o\.gguf"):
        open_checkpoint(path)
