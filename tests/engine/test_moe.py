"""Sparse mixture-of-experts MLPs (Qwen3-MoE) on the CPU: routing, quantized experts, checkpoint errors.
The logits against transformers are checked in test_models.py (arch "qwen3moe")."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError, ConfigError
from radiance.kernels.activation import Fp8Activations
from radiance.kernels.reference import quantize_activations_reference
from radiance.layers.moe import SparseMoeBlock
from radiance.models.moe_config import MoeConfig
from radiance.models.registry import resolve_architecture


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _load(path, **options):
    config = ModelConfig(device="cpu", dtype="float32", **options)
    return load_model(config, checkpoint=open_checkpoint(path), progress=False)


def test_router_weights_follow_norm_topk_prob():
    torch.manual_seed(0)
    moe = MoeConfig(num_experts=6, top_k=3, intermediate_size=8, norm_topk_prob=False, layers=frozenset({0}))
    block = SparseMoeBlock(16, moe)
    x = torch.randn(5, 16)
    probs = torch.softmax(block.gate(x), dim=-1)
    weights, ids = block.route(x)
    want, want_ids = probs.topk(3, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want)  # plain softmax probabilities, summing to less than 1
    assert bool((weights.sum(-1) < 1).all())
    block.norm_topk_prob = True
    torch.testing.assert_close(block.route(x)[0], want / want.sum(-1, keepdim=True))


def test_looped_experts_match_a_dense_sum():
    """Every expert on every token, weighted by a zero-filled routing matrix: the same as the sparse loop."""
    torch.manual_seed(0)
    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=8, norm_topk_prob=True, layers=frozenset({0}))
    block = SparseMoeBlock(16, moe)
    for expert in block.experts:
        expert.gate_up_proj = torch.nn.Linear(16, 16, bias=False)
        expert.down_proj = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(7, 16)
    weights, ids = block.route(x)
    dense = torch.zeros(7, 4).scatter(1, ids, weights)
    want = sum(dense[:, e:e + 1] * block.experts[e](x) for e in range(4))
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
    # the fused norm's hand-over (fp8 codes with their 16-bit values): routed and computed on the values here
    x_q, x_scale = quantize_activations_reference(x)
    torch.testing.assert_close(block(Fp8Activations(x_q, x_scale, x.dtype, (7,), x)), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="16-bit values"):
        block(Fp8Activations(x_q, x_scale, x.dtype, (7,)))


def test_grouped_16bit_experts_match_the_loop():
    """The grouped path of 16-bit experts (torch._grouped_mm, as on sm_90) run here on the CPU's grouped GEMM:
    the loop's result, including experts no token picked."""
    from radiance.layers.linear import DenseLinear

    torch.manual_seed(0)
    moe = MoeConfig(num_experts=6, top_k=2, intermediate_size=8, norm_topk_prob=True, layers=frozenset({0}))
    block = SparseMoeBlock(16, moe)
    for expert in block.experts:
        expert.gate_up_proj = DenseLinear(torch.randn(16, 16))
        expert.down_proj = DenseLinear(torch.randn(16, 8))
    x = torch.randn(3, 16)
    looped = block(x)
    block.grouped_16bit = (torch.stack([e.gate_up_proj.weight for e in block.experts]),
                           torch.stack([e.down_proj.weight for e in block.experts]))
    assert len(torch.unique(block.route(x)[1])) < 6
    torch.testing.assert_close(block(x), looped, rtol=1e-5, atol=1e-5)


def test_norm_topk_prob_is_applied(tiny_model_dir):
    """The same weights without renormalized router weights give other logits, so test_models' match
    depends on it being read."""
    path, _ = tiny_model_dir("qwen3moe")
    ckpt = open_checkpoint(path)
    ids = torch.randint(0, 256, (1, 40))
    normalized = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = dict(ckpt.config, norm_topk_prob=False)
    plain = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    assert _rel(plain.forward_logits(ids), normalized.forward_logits(ids)) > 1e-2


@pytest.mark.parametrize("quantization", ["mxfp4", "nvfp4"])
def test_experts_quantized_at_load(tiny_model_dir, quantization):
    """Every expert linear becomes MXFP4 (8 experts x 2 + 4 attention / dense linears); the router stays
    16-bit; logits carry a 4-bit error, not garbage."""
    path, hf = tiny_model_dir("qwen3moe")
    loaded = _load(path, quantization=quantization)
    assert "22 mxfp4" in loaded.summary[1]
    assert "mixture of experts: 1 layer on a loop over the picked experts" in loaded.summary  # the CPU's path
    block = loaded.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.gate.weight.dtype == torch.float32
    ids = torch.randint(0, 256, (1, 48))
    with torch.no_grad():
        ref = hf(ids).logits
    assert 1e-3 < _rel(loaded.model.forward_logits(ids), ref) < 2.0 * _mxfp4_oracle_error(hf, ids, ref)


def _mxfp4_oracle_error(hf, ids, ref) -> float:
    """The error of the HF model itself with its linear and expert weights rounded to MXFP4 (W4A16)."""
    import copy

    from radiance.formats import DenseWeight, dequantize, to_mxfp4

    def rounded(w):
        return dequantize(to_mxfp4(DenseWeight(w.detach().clone()))[0])

    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:  # stacked [E, N, K]
                param.copy_(torch.stack([rounded(w) for w in param]))
            elif name.endswith("proj.weight"):
                param.copy_(rounded(param))
        return _rel(model(ids).logits, ref)


def test_generation_through_the_engine(tiny_model_dir):
    """Paged decode over a sparse layer gives the tokens of a full forward (greedy)."""
    from radiance import LLM, SamplingParams

    path, _ = tiny_model_dir("qwen3moe")
    llm = LLM(path, device="cpu", dtype="float32")
    prompt = [5, 17, 99, 3, 42]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    tokens = list(prompt)
    for _ in range(6):
        logits = llm.engine.model.forward_logits(torch.tensor([tokens]))
        tokens.append(int(logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == tokens[len(prompt):]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_converted_checkpoint_serves_its_experts(tiny_model_dir, tmp_path, fmt):
    """`radiance convert` writes every expert in the 4-bit format (the router stays 16-bit), and loading the
    result serves the same MXFP4 weights as quantizing the 16-bit checkpoint at load (the converted file keeps
    its other tensors in bf16, so logits are not compared)."""
    from radiance.checkpoint import convert_checkpoint
    from radiance.config import ConvertConfig

    path, _ = tiny_model_dir("qwen3moe")
    out = str(tmp_path / fmt)
    convert_checkpoint(open_checkpoint(path), out, ConvertConfig(format=fmt), progress=False)
    names = load_file(os.path.join(out, "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight_packed" in names
    assert "model.layers.0.mlp.gate.weight" in names
    converted = dict(_load(out).model.named_modules())
    at_load = {name: m for name, m in _load(path, quantization=fmt).model.named_modules() if ".experts." in name}
    assert len(at_load) == 8 * 3  # each expert, its gate_up_proj and down_proj
    for name, module in at_load.items():
        if hasattr(module, "dequantized_weight"):
            assert torch.equal(converted[name].dequantized_weight(), module.dequantized_weight()), name


def _copy_checkpoint(src: str, dst, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_missing_expert_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen3moe")
    broken = _copy_checkpoint(path, tmp_path / "broken",
                              lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj"):
        open_checkpoint(broken)


def test_expert_of_wrong_shape_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen3moe")

    def shrink(tensors):
        name = "model.layers.0.mlp.experts.2.down_proj.weight"
        tensors[name] = tensors[name][:, :16].contiguous()

    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj"):
        open_checkpoint(_copy_checkpoint(path, tmp_path / "bad", shrink))


def test_experts_on_a_dense_architecture_are_refused():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "vocab_size": 10,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8}
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM"):
        resolve_architecture(config)


def test_moe_config_needs_expert_size():
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        MoeConfig.from_hf({"num_experts": 4, "num_experts_per_tok": 2}, "Qwen3MoeForCausalLM", 2)


def test_sparse_layers_follow_step_and_dense_list():
    config = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 2,
              "mlp_only_layers": [3]}
    assert MoeConfig.from_hf(config, "Qwen3MoeForCausalLM", 6).layers == frozenset({1, 5})


def test_shared_expert_is_applied(tiny_model_dir):
    """Qwen2-MoE's gated shared expert: with its gate closed the logits move, so test_models' match against
    transformers depends on it."""
    path, _ = tiny_model_dir("qwen2moe")
    model = _load(path).model
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.shared_expert is not None
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        full = model.forward_logits(ids)
        block.shared_expert_gate.weight.fill_(0.0)  # sigmoid(0) = 0.5 for every token
        half = model.forward_logits(ids)
    assert _rel(half, full) > 1e-2


def test_missing_shared_expert_gate_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen2moe")
    broken = _copy_checkpoint(path, tmp_path / "broken",
                              lambda t: t.pop("model.layers.1.mlp.shared_expert_gate.weight"))
    with pytest.raises(CheckpointError, match=r"shared_expert_gate"):
        open_checkpoint(broken)


def test_inspect_lists_experts_as_their_own_class(tiny_model_dir):
    from radiance.checkpoint.inspect import inspect_lines
    from radiance.checkpoint.names import layer_kind

    path, _ = tiny_model_dir("qwen3moe")
    lines = inspect_lines(open_checkpoint(path))
    assert any("experts 8 (top 2) of 32" in line for line in lines)
    assert "servable   yes" in lines
    rows = {line.split()[0]: int(line.split()[1]) for line in lines if line.strip().split()[:1]
            and line.split()[0].endswith("_proj")}
    assert rows["experts.gate_up_proj"] == 8 and rows["experts.down_proj"] == 8 and rows["gate_up_proj"] == 1
    assert layer_kind("model.layers.1.mlp.shared_expert.down_proj") == "shared_expert.down_proj"
