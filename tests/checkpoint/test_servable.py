"""Checkpoints radiance cannot serve: `inspect` shows them with a warning, `convert` refuses before writing, and
loading (generate / serve) fails with the same one line. Also the config.json variants that used to pass the
first two and fail only at load (rope scaling, head counts, biases) or not fail at all."""

import json
import os

import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.cli import main
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError, ConfigError
from radiance.kernels.glu import GELU_TANH, SILU
from radiance.models.registry import MODEL_CLASSES, resolve_architecture
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

SUPPORTED = ", ".join(MODEL_CLASSES)


def _dir(tmp_path, config_changes=None, tensors=None, name="src", **kwargs):
    config = {k: v for k, v in dict(TINY, **(config_changes or {})).items() if v is not None}
    return write_dir(str(tmp_path / name), dense_state_dict() if tensors is None else tensors, config, **kwargs)


def _load(path):
    return load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path), progress=False)


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"radiance {command}: error:"), err
    return err[0]


def _inspect(capsys, path, *options) -> tuple[int, str]:
    code = main(["--log-level", "ERROR", "inspect", path, *options])
    return code, capsys.readouterr().out


# ---------------------------------------------------------------- unknown architectures

@pytest.mark.parametrize("changes,named", [
    ({"architectures": ["FooForCausalLM"]}, "model architecture FooForCausalLM"),
    ({"architectures": None, "model_type": "foo"}, "model_type 'foo' (config.json lists no architectures)"),
    ({"architectures": None, "model_type": None},
     "model: config.json names no architecture (neither 'architectures' nor 'model_type')"),
], ids=["architectures", "model_type", "neither"])
def test_an_unknown_architecture_is_shown_refused_and_not_loaded_with_one_message(tmp_path, capsys, changes, named):
    path = _dir(tmp_path, changes, tokenizer=True)
    message = f"; radiance serves {SUPPORTED} (file {os.path.join(path, 'config.json')})"  # the file named too

    code, out = _inspect(capsys, path)  # the tensors are still shown
    assert code == 0 and "qkv_proj" in out and "model.embed_tokens.weight" in out
    assert f"servable   NO: unsupported {named}{message}" in out
    assert f"  - not servable: unsupported {named}{message}" in out
    assert _inspect(capsys, path, "--strict")[0] == 1

    assert main(["convert", path, str(tmp_path / "out"), "--no-progress"]) == 2
    assert _one_error_line(capsys, "convert").endswith(f"unsupported {named}{message}")
    assert not (tmp_path / "out").exists()

    with pytest.raises(ConfigError) as info:
        _load(path)
    assert str(info.value) == f"unsupported {named}{message}"
    assert main(["--log-level", "ERROR", "generate", "w3", "--model", path, "--device", "cpu",
                 "--max-tokens", "1"]) == 2
    assert _one_error_line(capsys, "generate").endswith(f"unsupported {named}{message}")


@pytest.mark.parametrize("architecture,match", [
    ("JambaForCausalLM", "unsupported model architecture JambaForCausalLM; radiance serves"),
    ("LlamaForCausalLM", "config.json gives LlamaForCausalLM 4 experts; radiance serves mixture-of-experts MLPs"),
])
def test_experts_radiance_cannot_serve_are_named_after_the_architecture(tmp_path, capsys, architecture, match):
    """A Mixtral-style config (experts of intermediate_size, no moe_intermediate_size) of an architecture radiance does
    not serve stopped `inspect` itself with "config.json of a model model with 4 experts lacks
    'moe_intermediate_size'"."""
    path = _dir(tmp_path, {"architectures": [architecture], "num_local_experts": 4, "num_experts_per_tok": 2})
    code, out = _inspect(capsys, path)
    assert code == 0 and f"servable   NO: {match}" in out
    with pytest.raises(ConfigError, match=match):
        _load(path)


@pytest.mark.parametrize("model_type,cls", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                            ("llama", "LlamaForCausalLM")])
def test_a_supported_model_type_without_architectures_is_served(model_type, cls):
    """transformers' Auto classes map model_type to the class; only llama was mapped before."""
    config = {k: v for k, v in TINY.items() if k != "architectures"}
    assert resolve_architecture(dict(config, model_type=model_type))[0] is MODEL_CLASSES[cls]


def test_a_servable_checkpoint_says_so(tmp_path, capsys):
    code, out = _inspect(capsys, _dir(tmp_path, tokenizer=True), "--strict")
    assert code == 0 and "servable   yes" in out and "warnings   none" in out


def test_a_checkpoint_without_a_tokenizer_is_a_warning(tmp_path, capsys):
    """Was: `inspect --strict` passed, and the model then served token-id prompts only."""
    path = _dir(tmp_path)
    code, out = _inspect(capsys, path, "--strict")
    assert code == 1 and "servable   yes" in out and ", no tokenizer" in out
    assert "  - no tokenizer: only token-id prompts can be served" in out
    code, out = _inspect(capsys, path, "--tokenizer")  # nothing to load: the same warning, not an error
    assert code == 0 and "tokenizer  " not in out and "  - no tokenizer" in out


# ---------------------------------------------------------------- rope scaling

@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "rope_scaling type 'ntk-by-parts' is not supported"),
    ({"rope_type": "longrope", "factor": 2.0}, "longrope rope_scaling needs 'short_factor': a list of 8 positive"),
    ({"type": "linear"}, "linear rope_scaling needs a positive number for 'factor', got None"),
    ({"rope_type": "llama3", "factor": 8.0},
     "llama3 rope_scaling needs a positive number for 'original_max_position_embeddings', got None"),
    ({"rope_type": "yarn", "factor": "4"}, "yarn rope_scaling needs a positive number for 'factor', got '4'"),
    ("linear", "config.json rope_scaling must be an object, got 'linear'"),
], ids=["unknown-type", "longrope-without-factors", "linear-without-factor", "llama3-without-original", "yarn-factor-string", "not-an-object"])
def test_a_bad_rope_scaling_is_one_line_everywhere(tmp_path, capsys, rope, match):
    """Were: silently passed inspect and convert; at load a KeyError / AttributeError traceback (the unknown
    type alone was a ConfigError, and only at load)."""
    path = _dir(tmp_path, {"rope_scaling": rope})
    assert match in _inspect(capsys, path)[1]
    assert main(["convert", path, str(tmp_path / "out"), "--no-progress"]) == 2
    assert match in _one_error_line(capsys, "convert")
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        _load(path)


def test_a_partial_rotary_factor_is_refused_not_ignored(tmp_path):
    """Rotating part of each head and serving it rotated whole gave wrong answers without a word."""
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 is not supported"):
        resolve_architecture(dict(TINY, partial_rotary_factor=0.5))


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_dynamic_rope_is_served_with_the_default_frequencies_transformers_uses(spelling):
    """transformers' dynamic NTK rope changes the frequencies only past max_position_embeddings, where
    radiance never goes (max_model_len is capped there): below it they are the default ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from radiance.layers.rotary import rope_inv_freq

    rope = {"rope_type": "dynamic", "factor": 4.0}
    config = dict(TINY, **{spelling: dict(rope, rope_theta=5000.0) if spelling == "rope_parameters" else rope})
    if spelling == "rope_scaling":
        config["rope_theta"] = 5000.0
    cfg = resolve_architecture(config)[1]
    assert cfg.rope_scaling is None and cfg.rope_theta == 5000.0
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                     rope_parameters=dict(rope, rope_theta=5000.0))
    reference, scale = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu")
    assert scale == 1.0 and torch.allclose(rope_inv_freq(16, cfg.rope_theta, cfg.rope_scaling), reference)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
], ids=["linear", "llama3", "yarn"])
def test_supported_rope_scalings_pass_and_reach_the_model(rope):
    assert resolve_architecture(dict(TINY, rope_scaling=rope))[1].rope_scaling == rope


# ---------------------------------------------------------------- head counts

def test_num_key_value_heads_missing_means_one_per_head(tmp_path):
    tensors = dense_state_dict()
    for i in range(TINY["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            tensors[f"model.layers.{i}.self_attn.{proj}.weight"] = 0.02 * torch.randn(64, 64)
    model = _load(_dir(tmp_path, {"num_key_value_heads": None}, tensors)).model
    assert model.config.num_kv_heads == 4 and model.config.head_dim == 16
    assert torch.isfinite(model.forward_logits(torch.tensor([[3, 4, 5]]))).all()


@pytest.mark.parametrize("changes,match", [
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
     "gives no head_dim and hidden_size 64 is not a multiple of num_attention_heads 5"),
])
def test_head_counts_that_cannot_split_are_config_errors(tmp_path, capsys, changes, match):
    """Were: a shape error about some projection (or, with matching tensors, a failure inside attention)."""
    path = _dir(tmp_path, changes)
    code, out = _inspect(capsys, path)
    assert code == 0 and match in out
    assert main(["convert", path, str(tmp_path / "out"), "--no-progress"]) == 2
    assert match in _one_error_line(capsys, "convert")
    with pytest.raises(ConfigError, match=match):
        _load(path)


# ---------------------------------------------------------------- tensors the model has no place for

def test_rotary_inv_freq_buffers_of_old_exports_are_skipped(tmp_path, capsys):
    """transformers < 4.31 saved `rotary_emb.inv_freq` in every Llama layer; loading said "tensor not used by
    the model" and stopped (transformers and vLLM skip them)."""
    tensors = dense_state_dict()
    for i in range(TINY["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    path = _dir(tmp_path, tensors=tensors, tokenizer=True)
    assert _inspect(capsys, path, "--strict")[0] == 0
    assert torch.isfinite(_load(path).model.forward_logits(torch.tensor([[3, 4]]))).all()
    convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert not any("inv_freq" in n for n in open_checkpoint(str(tmp_path / "out")).index.meta)


def test_an_unexpected_tensor_is_named_by_inspect_convert_and_load(tmp_path, capsys):
    """Was: inspect and convert passed it on silently; only loading the result stopped on it."""
    tensors = dict(dense_state_dict(), **{"model.mtp.fc.weight": torch.ones(8, 8)})
    path = _dir(tmp_path, tensors=tensors)
    code, out = _inspect(capsys, path)
    assert code == 0 and "1 tensor not used by the LlamaForCausalLM model (file " in out
    assert "tensor model.mtp.fc.weight)" in out
    with pytest.raises(CheckpointError, match="1 tensor not used by the LlamaForCausalLM model") as info:
        convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert info.value.tensor == "model.mtp.fc.weight"
    assert info.value.file == os.path.join(path, "model.safetensors")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="not used by the model") as info:
        _load(path)
    assert info.value.tensor == "model.mtp.fc.weight"


def test_weights_the_model_needs_but_the_checkpoint_lacks_stop_convert(tmp_path, capsys):
    """A Qwen2 checkpoint without its q/k/v biases converted fine and then failed to load."""
    path = _dir(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert "lacks 2 weight(s) the Qwen2ForCausalLM model needs, e.g. model.layers.0.self_attn.qkv_bias" \
        in _inspect(capsys, path)[1]
    with pytest.raises(CheckpointError, match="lacks 2 weight"):
        convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    with pytest.raises(CheckpointError, match="lacks 2 weight"):
        _load(path)


@pytest.mark.parametrize("tied,with_head", [(True, True), (True, False), (False, True), (None, True)])
def test_tied_and_untied_heads_that_load_pass_every_check(tmp_path, capsys, tied, with_head):
    tensors = dense_state_dict()  # TINY is untied: it has lm_head.weight
    if not with_head:
        tensors.pop("lm_head.weight")
    path = _dir(tmp_path, {"tie_word_embeddings": tied}, tensors, tokenizer=True)
    assert _inspect(capsys, path, "--strict")[0] == 0
    convert_checkpoint(path, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    loaded = _load(str(tmp_path / "out")).model
    assert (loaded.lm_head.tied_to is not None) == bool(tied)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_a_stale_lm_head_beside_tied_embeddings_does_not_replace_them(tmp_path, quantize_lm_head):
    """Tied config with an lm_head.weight stored too (unlike the embeddings here): the model serves the embeddings,
    but `convert --quantize-lm-head` quantized both and wrote the stale head over the embeddings' copy, so the
    converted model answered differently from quantizing at load."""
    tensors = dense_state_dict()  # its lm_head.weight differs from the embeddings
    path = _dir(tmp_path, {"tie_word_embeddings": True}, tensors)
    out = str(tmp_path / "out")
    report = convert_checkpoint(path, out, ConvertConfig(format="mxfp4", quantize_lm_head=quantize_lm_head),
                                progress=False)
    assert report.by_kind().get("lm_head", 0) == int(quantize_lm_head)
    assert "lm_head.weight" not in open_checkpoint(out).index.meta
    at_load = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4",
                                     quantize_lm_head=quantize_lm_head), checkpoint=open_checkpoint(path),
                         progress=False).model
    ids = torch.tensor([[3, 4, 5]])
    assert torch.allclose(_load(out).model.forward_logits(ids), at_load.forward_logits(ids), rtol=1e-4, atol=1e-4)


def test_the_shard_writer_refuses_a_tensor_written_twice(tmp_path):
    """Two tensors of one name silently kept the later (the stale head above); across shards, both."""
    from radiance.checkpoint.safetensors_io import ShardWriter

    writer = ShardWriter(str(tmp_path), max_shard_bytes=8)
    writer.add("lm_head.weight", torch.ones(4))
    with pytest.raises(CheckpointError, match="written twice") as info:
        writer.add("lm_head.weight", torch.zeros(4))
    assert info.value.tensor == "lm_head.weight"


# ---------------------------------------------------------------- biases and quantization_config

def test_llama_attention_bias_is_served_as_transformers_does(tmp_path):
    """`attention_bias: true` gives q, k, v and o a bias; they were "tensor not used by the model"."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attention_bias=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        reference = hf(ids).logits
    ours = _load(str(tmp_path)).model.forward_logits(ids)
    assert ((ours - reference).norm() / reference.norm()).item() <= 1e-3


@pytest.mark.parametrize("cls,qkv,o", [("LlamaForCausalLM", True, True), ("Qwen3ForCausalLM", True, True),
                                       ("Qwen2ForCausalLM", True, False)])
def test_attention_bias_gives_the_biases_each_class_has(cls, qkv, o):
    cfg = resolve_architecture(dict(TINY, architectures=[cls], attention_bias=True))[1]
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv, o)


def test_swish_is_silu():
    """transformers' ACT2FN["swish"] is SiLU; it was refused as an unsupported activation."""
    assert resolve_architecture(dict(TINY, hidden_act="swish"))[1].mlp_activation == SILU


def test_gelu_pytorch_tanh_is_a_geglu_on_dense_mlps():
    """A Llama-family hidden_act of gelu_pytorch_tanh is served as Gemma's GeGLU (it was refused); the logits
    against transformers: tests/engine/test_models.py's llama_gelu."""
    assert resolve_architecture(dict(TINY, hidden_act="gelu_pytorch_tanh"))[1].mlp_activation == GELU_TANH


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported \\(only silu or gelu_pytorch_tanh\\)"),
    ({"hidden_act": "gelu_pytorch_tanh", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "mixture-of-experts model \\(only silu\\)"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size 0"),
])
def test_unservable_mlps_are_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        resolve_architecture(dict(TINY, **changes))


def test_mlp_bias_is_refused():
    with pytest.raises(ConfigError, match="mlp_bias true is not supported"):
        resolve_architecture(dict(TINY, mlp_bias=True))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "unsupported quantization_config.quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization_config.quant_method 'gptq'"),
    ({"bits": 4}, "quantization_config has no quant_method"),
    ([1], "config.json field 'quantization_config' must be an object, got [1]"),
], ids=["awq", "gptq", "no-method", "a-list"])
def test_an_unreadable_quantization_config_is_one_line_naming_it(tmp_path, capsys, qc, match):
    """A list was read as "unquantized" (its packed codes as weights); a missing method said "quant_method None"."""
    path = _dir(tmp_path)
    with open(os.path.join(path, "config.json")) as handle:
        config = json.load(handle)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(dict(config, quantization_config=qc), handle)
    assert main(["inspect", path]) == 2
    assert match in _one_error_line(capsys, "inspect")
    assert main(["convert", path, str(tmp_path / "out"), "--no-progress"]) == 2
    assert match in _one_error_line(capsys, "convert")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_a_null_size_is_a_missing_size(key):
    """`"vocab_size": null` passed the presence check and failed later as a TypeError."""
    with pytest.raises(ConfigError, match=f"lacks '{key}'"):
        resolve_architecture(dict(TINY, **{key: None}))
