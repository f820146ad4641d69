"""Sparse-MLP GGUF files as llama.cpp writes them: the experts of each layer stacked in one tensor per projection
(`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, the experts' dimension last in GGUF's order), the router as
`ffn_gate_inp`. A llama file with experts is llama.cpp's Mixtral; a qwen3moe file Qwen3-MoE. Read back to
transformers' logits, in float32 and from int4 (Q4_0) experts."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.formats import Int4Weight, dequantize
from radiance.models.registry import resolve_architecture
from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors, write_gguf


def _qwen3moe():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, head_dim=32, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=512)
    torch.manual_seed(6)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf


def _logits_match(hf, path, tokens: int = 30, tolerance: float = 1e-5) -> None:
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path),
                      progress=False).model
    assert ((ours.forward_logits(ids) - ref).norm() / ref.norm()).item() <= tolerance


def test_a_qwen3moe_gguf_with_stacked_experts(tmp_path):
    hf = _qwen3moe()
    c = hf.config
    block = {**LLAMA_BLOCK, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    metadata = {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    path = write_gguf(tmp_path / "q.gguf", "qwen3moe", c, gguf_tensors(hf, block), metadata,
                      head_dim=32)
    ckpt = open_checkpoint(path)
    cls, cfg = resolve_architecture(ckpt.config)
    assert cls.__name__ == "Qwen3MoeForCausalLM" and cfg.moe.layers == {0, 1} and cfg.moe.norm_topk_prob
    entries = {e.name: e for e in ckpt.describe()}
    assert entries["model.layers.1.mlp.experts.7.gate_up_proj"].shape == (64, 64)  # gate | up of one expert
    assert entries["model.layers.1.mlp.experts.7.down_proj"].shape == (64, 32)
    _logits_match(hf, path)


def test_a_mixtral_gguf_is_a_llama_file_with_experts(tiny_model_dir, tmp_path):
    _, hf = tiny_model_dir("mixtral")
    c = hf.config
    tensors = gguf_tensors(hf, LLAMA_BLOCK, permute=True)
    metadata = {"llama.expert_count": 8, "llama.expert_used_count": 2}
    path = write_gguf(tmp_path / "m.gguf", "llama", c, tensors, metadata)
    cls, cfg = resolve_architecture(open_checkpoint(path).config)
    assert cls.__name__ == "MixtralForCausalLM" and cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    _logits_match(hf, path, tokens=20)  # within the tiny model's 24-token window (a llama file gives none)


def test_q4_0_experts_stay_4_bit_and_match_their_dequantized_values(tmp_path):
    """Stacked experts in Q4_0: each expert's slice read as an Int4Weight (no rounding) whose values are exactly the
    gguf package's dequantization of that expert, gate and up merged in order."""
    hf = _qwen3moe()
    block = {**LLAMA_BLOCK, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    metadata = {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    quantized = {name: (gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0) if "_exps" in name else values)
                 for name, values in gguf_tensors(hf, block).items()}
    q4 = gguf.GGMLQuantizationType.Q4_0
    path = write_gguf(tmp_path / "q4.gguf", "qwen3moe", hf.config, quantized, metadata, head_dim=32,
                      raw_types={name: q4 for name in quantized if "_exps" in name})
    weights = dict(open_checkpoint(path).iter_weights(progress=False))
    for layer, expert in ((0, 0), (1, 5)):
        gate_up = weights[f"model.layers.{layer}.mlp.experts.{expert}.gate_up_proj"]
        down = weights[f"model.layers.{layer}.mlp.experts.{expert}.down_proj"]
        assert isinstance(gate_up, Int4Weight) and isinstance(down, Int4Weight) and gate_up.partition_sizes == (32, 32)
        want = np.concatenate([gguf.quants.dequantize(quantized[f"blk.{layer}.ffn_{p}_exps.weight"][expert], q4)
                               for p in ("gate", "up")])
        assert torch.equal(dequantize(gate_up), torch.from_numpy(want))
        want = gguf.quants.dequantize(quantized[f"blk.{layer}.ffn_down_exps.weight"][expert], q4)
        assert torch.equal(dequantize(down), torch.from_numpy(want))


def test_a_qwen2moe_gguf_with_its_shared_expert(tmp_path):
    """qwen2moe: stacked experts, the shared expert (ffn_*_shexp) and its sigmoid gate (ffn_gate_inp_shexp), the top-k
    not renormalized; qkv biases."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512)
    torch.manual_seed(9)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    metadata = {"qwen2moe.expert_count": 8, "qwen2moe.expert_used_count": 2,
                "qwen2moe.expert_feed_forward_length": 32, "qwen2moe.expert_shared_feed_forward_length": 48}
    path = write_gguf(tmp_path / "q2.gguf", "qwen2moe", config, gguf_tensors(hf, LLAMA_BLOCK), metadata)
    cls, cfg = resolve_architecture(open_checkpoint(path).config)
    assert cls.__name__ == "Qwen2MoeForCausalLM" and cfg.moe.shared_expert_size == 48 and not cfg.moe.norm_topk_prob
    _logits_match(hf, path)


def test_experts_one_tensor_each_as_older_files_have_them(tmp_path):
    """Files converted before llama.cpp stacked the experts name one tensor per expert (blk.N.ffn_gate.E.weight):
    the same model as the stacked file."""
    hf = _qwen3moe()
    block = {**LLAMA_BLOCK, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    metadata = {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    tensors = {}
    for name, values in gguf_tensors(hf, block).items():
        if "_exps" in name:  # blk.N.ffn_gate_exps.weight -> blk.N.ffn_gate.E.weight
            stem = name.removesuffix("_exps.weight")
            tensors.update({f"{stem}.{e}.weight": values[e] for e in range(values.shape[0])})
        else:
            tensors[name] = values
    path = write_gguf(tmp_path / "old.gguf", "qwen3moe", hf.config, tensors, metadata, head_dim=32)
    _logits_match(hf, path)
