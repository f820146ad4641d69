"""gpt-oss on the CPU: its published MXFP4 layout of stacked experts, YaRN, sinks and windows, checkpoint
errors. The 16-bit logits against transformers are checked in test_models.py (arch "gptoss")."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.stacked_experts import gate_up_rows
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from radiance.formats import dequantize_mxfp4, quantize_mxfp4
from radiance.layers.linear import DenseLinear, Mxfp4Linear
from radiance.layers.rotary import rope_attention_factor, rope_inv_freq

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _load(path, **options):
    return load_model(ModelConfig(device="cpu", dtype="float32", **options), checkpoint=open_checkpoint(path),
                      progress=False).model


def _to_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32], the dequantized [N, K])."""
    packed, scale = quantize_mxfp4(rows)
    return packed.reshape(rows.shape[0], -1, 16), scale, dequantize_mxfp4(packed, scale)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_model_dir, tmp_path_factory):
    """The tiny gpt-oss saved as OpenAI publishes it (experts as `*_blocks` / `*_scales`, quant_method mxfp4),
    and the transformers model with its experts set to the dequantized MXFP4 values."""
    from tests.engine.conftest import tiny_hf_model

    src, _ = tiny_model_dir("gptoss")
    hf = tiny_hf_model("gptoss")
    path = tmp_path_factory.mktemp("gptoss-mxfp4")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = tensors.pop(name)  # [E, K, N], input-major
        blocks, scales, dequantized = zip(*(_to_blocks(w.t().contiguous()) for w in stacked))
        tensors[name + "_blocks"], tensors[name + "_scales"] = torch.stack(blocks), torch.stack(scales)
        with torch.no_grad():
            hf.get_parameter(name).copy_(torch.stack(dequantized).transpose(1, 2))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path), hf


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))  # past the 32-token window


def test_mxfp4_experts_read_as_published(gpt_oss_mxfp4, ids):
    """Dequantized (quantization none) the stacked MXFP4 experts give transformers' logits on the same values;
    served as they are (auto), every expert runs W4A8 and stays close."""
    path, hf = gpt_oss_mxfp4
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(_load(path, quantization="none").forward_logits(ids), ref) <= 1e-3
    served = _load(path)
    experts = [lin for layer in served.model.layers for e in layer.mlp.experts for lin in (e.gate_up_proj, e.down_proj)]
    assert len(experts) == 2 * 2 * 8 and all(isinstance(lin, Mxfp4Linear) for lin in experts)
    assert isinstance(served.model.layers[0].self_attn.qkv_proj, DenseLinear)  # modules_to_not_convert: 16-bit
    assert _rel(served.forward_logits(ids), ref) <= 0.1  # fp8 activations: ~7% on this random model


def test_gate_up_rows_are_regrouped():
    rows = torch.arange(6)[:, None].expand(6, 2)
    assert gate_up_rows(rows)[:, 0].tolist() == [0, 2, 4, 1, 3, 5]


def test_sinks_and_window_matter(tiny_model_dir, ids):
    """The transformers match (test_models.py) depends on both: without them the logits move."""
    path, _ = tiny_model_dir("gptoss")
    model = _load(path)
    ref = model.forward_logits(ids)
    attn = model.model.layers[0].self_attn
    saved = attn.sinks.detach().clone()
    with torch.no_grad():
        attn.sinks.fill_(-1e4)
    assert _rel(model.forward_logits(ids), ref) > 1e-2
    with torch.no_grad():
        attn.sinks.copy_(saved)
    attn.attn.sliding_window = None
    assert _rel(model.forward_logits(ids), ref) > 1e-2


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = GptOssConfig(head_dim=64, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 150000.0, rope), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(rope) == pytest.approx(factor)
    assert rope_attention_factor({"rope_type": "llama3", "factor": 8.0}) == 1.0


def _broken_copy(src: str, dst, edit) -> str:
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return str(dst)


def test_broken_stacked_experts_name_the_tensor(gpt_oss_mxfp4, tmp_path):
    path, _ = gpt_oss_mxfp4
    name = "model.layers.1.mlp.experts.down_proj_scales"
    cut = _broken_copy(path, tmp_path / "cut", lambda t: t.__setitem__(name, t[name][:, :, :1].contiguous()))
    with pytest.raises(CheckpointError, match="wrong shape") as err:
        open_checkpoint(cut)
    assert name in str(err.value)
    gone = _broken_copy(path, tmp_path / "gone", lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_bias"))
    with pytest.raises(CheckpointError, match="gate_up_proj_bias"):
        open_checkpoint(gone)


def test_the_published_layout_passes_the_servability_check(gpt_oss_mxfp4):
    """inspect and convert run it: stacked experts, sinks and router biases all have their place."""
    from radiance.checkpoint.servable import servability_problem

    assert servability_problem(open_checkpoint(gpt_oss_mxfp4[0])) is None


def test_inspect_lists_each_expert(gpt_oss_mxfp4):
    names = {e.name: e for e in open_checkpoint(gpt_oss_mxfp4[0]).describe()}
    gate_up = names["model.layers.0.mlp.experts.7.gate_up_proj"]
    assert gate_up.is_linear and gate_up.format == "mxfp4" and gate_up.shape == (256, 64)
    assert gate_up.partition_sizes == (128, 128)
    assert names["model.layers.1.mlp.experts.0.down_proj.bias"].shape == (64,)


BASE = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("extra, window, layers", [
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}, 8, {0, 2}),
    # without layer_types the even layers slide, as transformers' GptOssConfig derives them (its window: 128
    # when absent); use_sliding_window is not read
    ({"sliding_window": 8, "use_sliding_window": False}, 8, {0, 2}),
    ({"sliding_window": 8, "use_sliding_window": True}, 8, {0, 2}),
    ({"sliding_window": None, "layer_types": ["full_attention"] * 4}, None, set()),
    ({"sliding_window": None}, None, set()),
    ({}, 128, {0, 2}),
])
def test_sliding_window_layers_come_from_layer_types(extra, window, layers):
    from radiance.models.registry import resolve_architecture

    cfg = resolve_architecture(dict(BASE, **extra))[1]
    assert cfg.sliding_window == window and set(cfg.sliding_layers) == layers
    assert [cfg.window_of(i) for i in range(4)] == [window if i in layers else None for i in range(4)]


@pytest.mark.parametrize("extra, message", [
    ({"sliding_window": 8, "layer_types": ["sliding_attention"] * 3}, "3 layer_types for 4 layers"),
    ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
])
def test_unclear_sliding_windows_are_config_errors(extra, message):
    from radiance.errors import ConfigError
    from radiance.models.registry import resolve_architecture

    with pytest.raises(ConfigError, match=message):
        resolve_architecture(dict(BASE, **extra))


def test_gpt_oss_moe_config():
    from radiance.models.registry import resolve_architecture

    moe = resolve_architecture(dict(BASE, swiglu_limit=5.0))[1].moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (4, 2, 32, True)
    assert moe.layers == frozenset(range(4)) and moe.router_bias and moe.expert_bias
    assert (moe.activation.kind, moe.activation.alpha, moe.activation.limit) == ("swiglu_oai", 1.702, 5.0)


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_attention_biases_are_added_by_their_linears(tiny_model_dir, ids, quantization):
    """After loading, the q/k/v and o biases live in their linears (the GEMM's epilogue adds them: one launch
    less each), and they still matter."""
    path, _ = tiny_model_dir("gptoss")
    model = _load(path, quantization=quantization)
    attn = model.model.layers[1].self_attn
    linear_type = DenseLinear if quantization == "none" else Mxfp4Linear
    assert isinstance(attn.qkv_proj, linear_type) and isinstance(attn.o_proj, linear_type)
    assert attn.qkv_bias is None and attn.o_bias is None
    assert attn.qkv_proj.bias.shape == (attn.qkv_proj.out_features,)
    assert attn.o_proj.bias.shape == (attn.o_proj.out_features,) and attn.o_proj.bias.abs().sum() > 0
    ref = model.forward_logits(ids[:, :40])
    for linear in (attn.qkv_proj, attn.o_proj):
        saved, linear.bias = linear.bias, None
        assert _rel(model.forward_logits(ids[:, :40]), ref) > 1e-3
        linear.bias = saved


def test_hidden_act_is_not_read_as_transformers_does_not_read_it(tiny_model_dir):
    """gpt-oss's experts use their clamped SwiGLU whatever hidden_act says; a config naming another was refused."""
    from radiance.models.registry import resolve_architecture

    path, _ = tiny_model_dir("gptoss")
    with open(os.path.join(path, "config.json")) as handle:
        config = {**json.load(handle), "hidden_act": "gelu"}
    assert resolve_architecture(config)[0].__name__ == "GptOssForCausalLM"
