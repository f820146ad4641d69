"""Our 16-bit models against the transformers implementation of the same weights (fp32, rel <= 1e-3)."""

from __future__ import annotations

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import ConfigError
from radiance.models.registry import resolve_architecture


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ARCHS = ["llama3", "llama_gelu", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gptoss", "mistral", "phi3", "phi3longrope", "gemma3",
         "smollm3", "olmo2", "olmo3", "granite", "mixtral", "gemma2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_model_dir):
    path, hf = tiny_model_dir(arch)
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path), progress=False)
    assert loaded.model.config.architecture == type(hf).__name__
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 300))  # past original_max_position_embeddings of the llama3 rope
    with torch.no_grad():
        ref = hf(ids).logits
    ours = loaded.model.forward_logits(ids)
    assert ours.shape == ref.shape
    assert _rel(ours, ref) <= 1e-3


def test_llama3_rope_scaling_is_applied(tiny_model_dir):
    """The same weights with the rope scaling removed must give different logits, so the match above
    depends on the scaling being right."""
    path, _ = tiny_model_dir("llama3")
    ckpt = open_checkpoint(path)
    scaled = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = {k: v for k, v in ckpt.config.items() if k not in ("rope_scaling", "rope_parameters")}
    plain = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ids = torch.randint(0, 256, (1, 200))
    assert _rel(plain.forward_logits(ids), scaled.forward_logits(ids)) > 1e-2


def test_unknown_architecture_is_a_config_error():
    with pytest.raises(ConfigError, match="MambaForCausalLM"):
        resolve_architecture({"architectures": ["MambaForCausalLM"], "hidden_size": 8})


def test_unsupported_rope_is_a_config_error(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    ckpt = open_checkpoint(path)
    ckpt.config = dict(ckpt.config, rope_scaling={"rope_type": "longrope", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(ConfigError, match="longrope"):
        load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False)


@pytest.fixture(scope="module")
def smollm2_hf_and_prompt():
    """transformers' own GGUF reader of the embedded file (from_pretrained(gguf_file=) would also want
    accelerate), in float32, and a prompt."""
    import os

    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from radiance.checkpoint import embedded_model_path

    path = embedded_model_path()
    hf = LlamaForCausalLM(AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)))
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    missing = hf.load_state_dict(state, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to the embedding
    hf = hf.float().eval()
    tokenizer = open_checkpoint(path).tokenizer()
    ids = torch.tensor([tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids])
    with torch.no_grad():
        return hf(ids).logits, ids


def test_smollm2_gguf_logits_match_transformers(smollm2_hf_and_prompt):
    """Our GGUF-loaded SmolLM2, served exactly (float32, dequantized weights), against transformers."""
    from radiance.config import KernelConfig

    ref, ids = smollm2_hf_and_prompt
    exact = load_model(ModelConfig(device="cpu", dtype="float32"), KernelConfig(cpu_int4=False), progress=False)
    assert "dense" in exact.summary[1] and "int4" not in exact.summary[1]
    ours = exact.model.forward_logits(ids)
    assert _rel(ours, ref) <= 1e-3
    assert ours[0, -1].argmax() == ref[0, -1].argmax()


def test_served_smollm2_stays_close_to_exact(smollm2, smollm2_hf_and_prompt):
    """The default CPU serving (Q4_1 codes on the int4 kernel, bfloat16 where the CPU has it) against the
    exact float32 logits: measured mean KL 1.7e-3 (bf16) / 6.4e-4 (float32), the same answer."""
    ref, ids = smollm2_hf_and_prompt
    assert any("120 4-bit GGUF linears on the int4 CPU kernel" in line for line in smollm2.engine.load_summary)
    ours = smollm2.engine.model.forward_logits(ids).float()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert 0 < kl.mean() <= 5e-3
    assert ours[0, -1].argmax() == ref[0, -1].argmax()


@pytest.mark.parametrize("quantization,rule,served", [("mxfp4", "mse", "mxfp4"), ("nvfp4", "mse", "mxfp4"),
                                                       ("nvfp4", "none", "nvfp4-dequant"), ("none", "mse", "dense")])
def test_quantization_options(tiny_model_dir, quantization, rule, served):
    """Quantizing at load: every linear served as asked, logits near the 16-bit ones (4-bit error, not garbage)."""
    path, hf = tiny_model_dir("qwen3")
    config = ModelConfig(device="cpu", dtype="float32", quantization=quantization, rule=rule)
    loaded = load_model(config, checkpoint=open_checkpoint(path), progress=False)
    assert f"8 {served}" in loaded.summary[1]
    ids = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        ref = hf(ids).logits
    err = _rel(loaded.model.forward_logits(ids), ref)
    if served == "dense":
        assert err <= 1e-3
    else:  # about the error of the same HF model with its weights rounded to MXFP4 (W4A16 oracle)
        assert 1e-3 < err < 2.0 * _mxfp4_oracle_error(hf, ids, ref)


@pytest.mark.parametrize("stored", ["mxfp4", "nvfp4"])
def test_rule_none_names_the_format_whose_values_it_serves_16_bit(stored):
    """--quantization nvfp4 --rule none on a checkpoint already stored 4-bit: an MXFP4 weight is served dequantized
    and its summary says mxfp4-dequant (it said nvfp4-dequant, a format it never was), with the stored values."""
    from radiance.config import KernelConfig
    from radiance.engine.linears import build_linear
    from radiance.formats import DenseWeight, dequantize, to_mxfp4
    from radiance.formats.nvfp4 import quantize_nvfp4
    from radiance.formats.weights import Nvfp4Weight

    dense = torch.randn(64, 96)
    weight = to_mxfp4(DenseWeight(dense))[0] if stored == "mxfp4" else Nvfp4Weight(*quantize_nvfp4(dense, None))
    module, how, err = build_linear("x", weight, ModelConfig(quantization="nvfp4", rule="none"), KernelConfig(),
                                    torch.float32)
    assert (how, err) == (f"{stored}-dequant", 0.0)
    torch.testing.assert_close(module(torch.eye(96)), dequantize(weight).t(), rtol=0, atol=0)


def _mxfp4_oracle_error(hf, ids, ref) -> float:
    import copy

    from radiance.formats import DenseWeight, dequantize, to_mxfp4

    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in rounded.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize(to_mxfp4(DenseWeight(module.weight.detach().clone()))[0]))
        return _rel(rounded(ids).logits, ref)


def test_ignore_keeps_matching_linears_16bit(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    config = ModelConfig(device="cpu", dtype="float32", quantization="mxfp4", ignore=(r"\.mlp\.",))
    loaded = load_model(config, checkpoint=open_checkpoint(path), progress=False)
    assert "4 dense" in loaded.summary[1] and "4 mxfp4" in loaded.summary[1]


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])  # untied head, tied head
def test_quantize_lm_head(tiny_model_dir, arch):
    """quantize_lm_head: the head is served as MXFP4 (its weight exactly the 16-bit head rounded by the rule),
    a tied embedding keeps its 16-bit values for the lookups, and the logits move by a 4-bit error only."""
    from radiance.formats import DenseWeight, dequantize, to_mxfp4
    from radiance.layers.linear import Mxfp4Linear

    path, hf = tiny_model_dir(arch)
    plain = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4"),
                       checkpoint=open_checkpoint(path), progress=False)
    loaded = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4", quantize_lm_head=True),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "9 mxfp4" in loaded.summary[1] and "8 mxfp4" in plain.summary[1]
    head = loaded.model.lm_head.linear
    assert isinstance(head, Mxfp4Linear)
    expected = dequantize(to_mxfp4(DenseWeight(hf.lm_head.weight.detach().float()))[0])
    torch.testing.assert_close(head.dequantized_weight().float(), expected, rtol=0, atol=0)
    embed = loaded.model.model.embed_tokens.weight
    torch.testing.assert_close(embed, hf.model.embed_tokens.weight.float(), rtol=0, atol=0)
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        ours, before = loaded.model.forward_logits(ids), plain.model.forward_logits(ids)
    assert 1e-3 < _rel(ours, before) < 0.2


def test_two_term_lm_head(tiny_model_dir):
    """lm_head_format mxfp4x2: the head is Q1 + Q2 (the rule's rounding of the head, then of its residual),
    reported as mxfp4x2, and its logits lie much closer to the 16-bit head's than the one-term head's do."""
    from radiance.formats import dense_to_mxfp4_pair, dequantize_mxfp4
    from radiance.layers.linear import Mxfp4PairLinear

    path, hf = tiny_model_dir("llama3")
    configs = {head: ModelConfig(device="cpu", dtype="float32", quantization="mxfp4", quantize_lm_head=head is not None,
                                 lm_head_format=head or "mxfp4") for head in (None, "mxfp4", "mxfp4x2")}
    loaded = {head: load_model(c, checkpoint=open_checkpoint(path), progress=False) for head, c in configs.items()}
    pair = loaded["mxfp4x2"]
    assert "8 mxfp4, 1 mxfp4x2" in pair.summary[1]
    head = pair.model.lm_head.linear
    assert isinstance(head, Mxfp4PairLinear)
    packed, scale, _ = dense_to_mxfp4_pair(hf.lm_head.weight.detach().float())
    both = dequantize_mxfp4(packed, scale)
    torch.testing.assert_close(head.dequantized_weight(), both[:, :64] + both[:, 64:], rtol=0, atol=0)
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        logits = {h: lm.model.forward_logits(ids) for h, lm in loaded.items()}
    assert 0 < _rel(logits["mxfp4x2"], logits[None]) < _rel(logits["mxfp4"], logits[None]) / 4


def test_build_lm_head_routes_by_format():
    """build_lm_head: mxfp4x2 makes two terms of a 16-bit or NVFP4 head; a head stored as MXFP4 stays one term
    (it is exact already), and the default format is build_linear's MXFP4."""
    from radiance.config import KernelConfig
    from radiance.engine.linears import build_lm_head
    from radiance.formats import DenseWeight, Mxfp4Weight, Nvfp4Weight, quantize_mxfp4, quantize_nvfp4
    from radiance.layers.linear import Mxfp4Linear, Mxfp4PairLinear

    w = torch.randn(48, 64)
    pair = ModelConfig(quantization="mxfp4", quantize_lm_head=True, lm_head_format="mxfp4x2")
    one = ModelConfig(quantization="mxfp4", quantize_lm_head=True)
    for weight in (DenseWeight(w), Nvfp4Weight(*quantize_nvfp4(w))):
        module, how, err = build_lm_head(weight, pair, KernelConfig(), torch.float32)
        assert isinstance(module, Mxfp4PairLinear) and how == "mxfp4x2" and 0 < err < 0.05
    stored = Mxfp4Weight(*quantize_mxfp4(w))
    for config in (pair, one):
        module, how, err = build_lm_head(stored, config, KernelConfig(), torch.float32)
        assert isinstance(module, Mxfp4Linear) and how == "mxfp4" and err == 0
    module, how, err = build_lm_head(DenseWeight(w), one, KernelConfig(), torch.float32)
    assert isinstance(module, Mxfp4Linear) and how == "mxfp4" and 0.05 < err < 0.2


def test_quantize_lm_head_needs_quantization():
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization mxfp4 or nvfp4"):
        ModelConfig(quantization="auto", quantize_lm_head=True)
    with pytest.raises(ValueError, match="applies to a quantized lm_head"):
        ModelConfig(quantization="mxfp4", lm_head_format="mxfp4x2")
    with pytest.raises(ValueError, match="lm_head_format must be one of"):
        ModelConfig(quantization="mxfp4", quantize_lm_head=True, lm_head_format="fp8")
    with pytest.raises(ValueError, match="needs a rule other than 'none'"):
        ModelConfig(quantization="nvfp4", rule="none", quantize_lm_head=True, lm_head_format="mxfp4x2")


def test_default_dtype():
    """float32 on a CPU (bf16 greedy answers differ between CPUs with and without native bf16), bfloat16 on CUDA;
    an explicit dtype always wins."""
    from radiance.engine.devices import resolve_dtype

    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32


@pytest.mark.parametrize("arch, rotary", [
    ("phi3longrope", "LongRoPE: the short factors for a max_model_len up to 32, the long ones above it; "
                     "12 of 16 dims per head rotate"),
    ("smollm3", "no rotary (NoPE) on layers 1"),
    ("olmo3", "sliding layers rotate with base 10000, the others 150000"),
    ("llama3", None),
])
def test_inspect_says_what_is_unusual_about_the_rotary(tiny_model_dir, arch, rotary):
    from radiance.checkpoint.inspect import inspect_lines

    lines = [line[len("rotary     "):] for line in inspect_lines(open_checkpoint(tiny_model_dir(arch)[0]))
             if line.startswith("rotary ")]
    assert lines == ([rotary] if rotary else [])


@pytest.mark.parametrize("rope", [
    None,  # the llama3 rope of the tiny model (original 64 in the scaling)
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 5000.0},
], ids=["llama3", "yarn"])
def test_a_top_level_original_context_takes_priority_as_in_transformers(tiny_model_dir, tmp_path, rope):
    """transformers gives config.json's top-level original_max_position_embeddings priority over the rope scaling's
    own for llama3 / yarn (as radiance already did for longrope); radiance used the scaling's: logprobs 3.5-4 off."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    source, _ = tiny_model_dir("llama3")
    path = tmp_path / "m"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    if rope is not None:
        config["rope_parameters"] = rope
    config["original_max_position_embeddings"] = 32  # not the scaling's 64 / 256
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 32  # transformers' reading
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(path)),
                        progress=False)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(3))  # inside yarn's 32 x 4
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(loaded.model.forward_logits(ids), ref) <= 1e-3


@pytest.mark.parametrize("differs", [True, False])
def test_a_tied_model_s_stored_head_is_named_when_it_differs(tiny_model_dir, tmp_path, caplog, differs):
    """tie_word_embeddings with an lm_head.weight stored too: the embeddings serve (as vLLM); a stored head that
    differs (a wrong tie flag: transformers 5 serves it instead) was dropped with a debug line only."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, _ = tiny_model_dir("qwen2")  # tied
    path = tmp_path / "m"
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding + 0.5 if differs else embedding.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="radiance.engine.loader"):
        loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(path)),
                            progress=False)
    warned = [r.getMessage() for r in caplog.records if "tie_word_embeddings" in r.getMessage()]
    assert len(warned) == int(differs), warned
    if differs:
        assert "also stores an lm_head.weight that differs from the embeddings" in warned[0]
    assert loaded.model.lm_head.tied_to is loaded.model.model.embed_tokens  # served tied either way
