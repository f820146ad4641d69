"""Qwen3.5 (Qwen3_5ForCausalLM, and the language model of Qwen3_5ForConditionalGeneration) as transformers computes it:
Gated DeltaNet linear-attention layers beside output-gated full attention, 1 + weight norms, a quarter of each head
rotating; the engine keeps each sequence's linear-attention state in a slot (engine.state_cache)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from radiance import LLM, SamplingParams
from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError, ConfigError
from radiance.models.registry import resolve_architecture


def _forward(path_or_ckpt, ids, **options):
    ckpt = open_checkpoint(path_or_ckpt) if isinstance(path_or_ckpt, str) else path_or_ckpt
    config = ModelConfig(device="cpu", dtype=options.pop("dtype", "float32"), **options)
    return load_model(config, checkpoint=ckpt, progress=False).model.forward_logits(ids)


def _prompts(count: int, length: int, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length + 3 * i,), generator=gen).tolist() for i in range(count)]


def _hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():  # EOS is a token like any other here, as the engine's ignore_eos makes it
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_config_as_transformers_reads_it():
    from transformers import Qwen3_5TextConfig

    config = {**Qwen3_5TextConfig().to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    cls, cfg = resolve_architecture(config)
    assert cls.__name__ == "Qwen3_5ForCausalLM"
    assert cfg.linear_layers == frozenset(i for i in range(32) if (i + 1) % 4)  # full attention every fourth layer
    assert cfg.attention_layer_ids == [3, 7, 11, 15, 19, 23, 27, 31]
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (16, 32, 128,
                                                                                                          128, 4)
    assert la.conv_channels == 2 * 16 * 128 + 32 * 128
    assert cfg.head_dim == 256 and cfg.rotary_dim == 64 and cfg.qk_norm and cfg.attention_output_gate


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention"] * 3}, "lists 3 layer_types for 32 layers"),
    ({"layer_types": ["sliding_attention"] * 32}, "unsupported layer_types"),
    ({"linear_num_value_heads": 24, "linear_num_key_heads": 16}, "not a multiple"),
    ({"linear_conv_kernel_dim": 1}, "at least 2"),
    ({"linear_key_head_dim": "128"}, "linear_key_head_dim"),
])
def test_configs_radiance_cannot_serve_are_one_line(change, message):
    from transformers import Qwen3_5TextConfig

    config = {**Qwen3_5TextConfig().to_dict(), "architectures": ["Qwen3_5ForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message):
        resolve_architecture(config)


HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def test_qwen3_next_and_qwen3_5_moe_configs_as_transformers_reads_them():
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    # transformers' Qwen3NextConfig defaults are Qwen3-Next-80B-A3B's sizes
    cls, cfg = resolve_architecture({**Qwen3NextConfig().to_dict(), "architectures": ["Qwen3NextForCausalLM"]})
    assert cls.__name__ == "Qwen3NextForCausalLM" and len(cfg.linear_layers) == 36 and cfg.rotary_dim == 64
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_size) == (512, 10, 512, 512)
    assert moe.norm_topk_prob and moe.shared_expert_gated and moe.layers == set(range(48))
    assert resolve_architecture({**Qwen3NextConfig().to_dict(), "architectures": ["Qwen3NextForCausalLM"],
                                 "mlp_only_layers": [0, 1]})[1].moe.layers == set(range(2, 48))
    # Qwen3.5-MoE's router always renormalizes: transformers reads no norm_topk_prob for it
    cls, cfg = resolve_architecture({**Qwen3_5MoeTextConfig().to_dict(), "architectures": ["Qwen3_5MoeForCausalLM"]})
    assert cls.__name__ == "Qwen3_5MoeForCausalLM" and cfg.moe.norm_topk_prob and cfg.moe.num_experts == 256
    assert cfg.linear_layers == frozenset(i for i in range(40) if (i + 1) % 4)


@pytest.mark.parametrize("model", HYBRIDS)
def test_logits_match_transformers(tiny_model_dir, model):
    """forward_logits (no cache: each row from a zero state) equals transformers' in float32, over two rows and past
    one 64-token chunk of the delta rule: Qwen3.5, its MoE (routed experts, gated shared expert) and Qwen3-Next (the
    projections grouped by key head, a dense first MLP)."""
    path, hf = tiny_model_dir(model)
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
    got = _forward(path, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-5  # float32 sums in other orders (MoE: 4e-4 at most)


@pytest.mark.parametrize("model", HYBRIDS)
@pytest.mark.parametrize("chunk", [None, 7])
def test_engine_greedy_tokens_match_transformers(tiny_model_dir, model, chunk):
    """The prompt whole or in 7-token chunks (each continuing the states its predecessor left), then 23 decodes."""
    path, hf = tiny_model_dir(model)
    prompt = _prompts(1, 30)[0]
    llm = LLM(path, device="cpu", dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    assert _greedy(llm, [prompt], 24) == [_hf_greedy(hf, prompt, 24)]


def test_a_batch_keeps_each_sequence_in_its_own_slot(tiny_model_dir):
    """Five prompts of different lengths through two slots (max_num_seqs 2: three wait, then take the slots the
    finished ones gave back) answer as each does alone in transformers; every slot is free at the end."""
    path, hf = tiny_model_dir("qwen3_5")
    prompts = _prompts(5, 9, seed=7)
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16)
    assert _greedy(llm, prompts, 10) == [_hf_greedy(hf, p, 10) for p in prompts]
    slots = llm.engine.block_manager.state_slots
    assert slots.count == 2 and slots.num_free == 2


def test_preempted_sequences_recompute_from_a_fresh_state(tiny_model_dir):
    """A cache of 8 blocks of 16 tokens for four 30-odd-token prompts growing by 30: sequences are preempted (their
    slot given back) and recomputed from their tokens, still transformers' answers."""
    path, hf = tiny_model_dir("qwen3_5")
    prompts = _prompts(4, 30, seed=9)
    llm = LLM(path, device="cpu", dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=32,
              max_model_len=96)
    assert _greedy(llm, prompts, 30) == [_hf_greedy(hf, p, 30) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.state_slots.num_free == llm.engine.block_manager.state_slots.count


def test_the_engine_serves_it_without_what_a_state_cannot_undo(tiny_model_dir, caplog):
    """Prefix caching and n-gram speculation asked for are turned off, with one log line naming them; the KV cache
    holds only the full-attention layer (one of four)."""
    path, _ = tiny_model_dir("qwen3_5")
    with caplog.at_level("INFO", logger="radiance"):
        llm = LLM(path, device="cpu", dtype="float32", ngram_draft_tokens=4, enable_prefix_caching=True)
    config = llm.engine.config
    assert not config.cache.enable_prefix_caching and config.speculative.ngram_draft_tokens == 0
    assert "prefix caching, n-gram speculative decoding off for this model" in caplog.text
    assert llm.engine.runner.kv_cache.shape[1] == 1  # one layer slot per page
    prompt = _prompts(1, 20)[0]  # the same prompt twice: the second recomputes it (no cached prefix to take)
    assert _greedy(llm, [prompt], 5) == _greedy(llm, [prompt], 5)


def _rewrite(path: str, out: str, rename, extra: dict | None = None, config_change=None) -> None:
    tensors = {rename(name): t for name, t in load_file(os.path.join(path, "model.safetensors")).items()}
    os.makedirs(out, exist_ok=True)
    save_file(dict(tensors, **(extra or {})), os.path.join(out, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config_change(config) if config_change else config, f)


def test_the_vision_language_checkpoint_serves_its_language_model(tiny_model_dir, tmp_path):
    """Qwen3_5ForConditionalGeneration as transformers saves it: the language model under model.language_model, a
    vision tower and multi-token-prediction weights beside it (not read); the text model's logits."""
    path, _ = tiny_model_dir("qwen3_5")

    def wrap(config):
        text = dict(config, model_type="qwen3_5_text")
        text.pop("architectures")
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
                "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}, "tie_word_embeddings": False}

    out = str(tmp_path / "vl")
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(48, 16), "mtp.fc.weight": torch.zeros(64, 128)}
    _rewrite(path, out, lambda n: n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n,
             extra, wrap)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_forward(out, ids), _forward(path, ids))


def test_qwen3_next_multi_token_prediction_weights_are_not_read(tiny_model_dir, tmp_path):
    """Qwen3-Next's checkpoints carry `mtp.*` weights (a draft model): served without them, the same logits."""
    path, _ = tiny_model_dir("qwen3_next")
    out = str(tmp_path / "mtp")
    _rewrite(path, out, lambda n: n, {"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.ones(64),
                                      "mtp.layers.0.self_attn.q_proj.weight": torch.zeros(128, 64)})
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_forward(out, ids), _forward(path, ids))


def test_a_missing_linear_attention_tensor_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen3_5")
    out = str(tmp_path / "no-alog")
    _rewrite(path, out, lambda n: n)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    del tensors["model.layers.3.linear_attn.A_log"]
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.linear_attn\.A_log"):
        open_checkpoint(out)


def test_a_wrong_linear_attention_shape_is_named(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen3_5")
    out = str(tmp_path / "bad-z")
    _rewrite(path, out, lambda n: n)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors["model.layers.1.linear_attn.in_proj_z.weight"] = torch.zeros(16, 64)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"in_proj_z.*expected \[32, 64\]|expected \[32, 64\].*in_proj_z"):
        open_checkpoint(out)


def test_mxfp4_at_load_and_converted_on_disk_serve_the_same_logits(tiny_model_dir, tmp_path):
    """Every linear on MXFP4 at load (3 linear-attention layers x 5 projections, 1 x (qkv + o), 4 x (gate_up + down));
    the same logits, bit for bit, from what `radiance convert` wrote."""
    path = str(tmp_path / "bf16")
    _rewrite(tiny_model_dir("qwen3_5")[0], path, lambda n: n)
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "linears: 25 mxfp4" in "\n".join(loaded.summary)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    at_load = loaded.model.forward_logits(ids)
    convert_checkpoint(path, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    assert torch.equal(at_load, _forward(str(tmp_path / "mx"), ids, dtype="bfloat16"))


def test_inspect_describes_the_hybrid_layers(tiny_model_dir):
    from radiance.checkpoint.inspect import _attention_line, _kv_line

    path, _ = tiny_model_dir("qwen3_5")
    config = open_checkpoint(path).config
    assert _attention_line(config) == "Gated DeltaNet linear attention on 3 of 4 layers, full causal on layers 2"
    # K and V of 2 heads x 16 in 16 bits on the one attention layer (128 B); per linear layer a conv tail of
    # 96 channels x 3 in 16 bits and 4 value heads' 16 x 8 float32 state: 3 x (576 + 2048) B
    assert _kv_line(config) == ("0.1 KiB per token in 16 bits; a sequence of the whole context (512 tokens): 64.0 KiB; "
                                "the 3 linear-attention layers keep 7.7 KiB of state per sequence instead, whatever "
                                "its length")


def test_max_num_seqs_is_lowered_to_the_states_that_fit(tiny_model_dir, caplog):
    """Each sequence's states take 3 x (96 x 3 + 4 x 16 x 8) x 4 B = 9600 B in float32: half a CPU budget of 128 KiB
    (MAX_STATE_SHARE) holds 6, and max_num_seqs 64 comes down to that with a warning; the engine still serves more
    prompts than that (they wait their turn)."""
    path, hf = tiny_model_dir("qwen3_5")
    with caplog.at_level("WARNING", logger="radiance"):
        llm = LLM(path, device="cpu", dtype="float32", cpu_kv_cache_bytes=128 << 10, max_model_len=64)
    assert llm.engine.config.scheduler.max_num_seqs == 6 and llm.engine.block_manager.state_slots.count == 6
    assert "max_num_seqs lowered to 6 from 64" in caplog.text
    # the KV cache takes what the states leave of the budget: (131072 - 6 x 9600) // (16 tokens x 256 B) blocks
    assert llm.engine.runner.num_blocks == 17
    prompts = _prompts(9, 5, seed=11)
    assert _greedy(llm, prompts, 4) == [_hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.parametrize("model, tensor", [("qwen3_5_moe", "model.layers.2.linear_attn.in_proj_z.weight"),
                                           ("qwen3_next", "model.layers.2.linear_attn.in_proj_ba.weight")])
def test_the_moe_models_checkpoints_are_checked_too(tiny_model_dir, tmp_path, model, tensor):
    """A linear-attention projection missing from a Qwen3.5-MoE (no intermediate_size in its config) or Qwen3-Next
    checkpoint is named when the checkpoint opens."""
    path, _ = tiny_model_dir(model)
    out = str(tmp_path / "missing")
    _rewrite(path, out, lambda n: n)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    del tensors[tensor]
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        open_checkpoint(out)


def test_a_slot_is_zeroed_as_it_is_handed_out(tiny_model_dir):
    """A finished sequence leaves its states in its slot; the next sequence to take the slot finds it zeroed (the
    CUDA decode kernels continue whatever a slot holds, and a sequence may start in a one-token step)."""
    path, _ = tiny_model_dir("qwen3_5")
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=1)
    _greedy(llm, _prompts(1, 12), 3)
    layers = llm.engine.model.linear_attention_layers()
    assert all(layer.recurrent_state[0].any() and layer.conv_state[0].any() for layer in layers)
    assert llm.engine.block_manager.state_slots.take() == 0
    assert not any(layer.recurrent_state[0].any() or layer.conv_state[0].any() for layer in layers)


def test_lora_serves_the_gated_attention(tiny_model_dir):
    """LoRA on: the gated q_proj's partition is twice the queries (its gates too); without an adapter the base's
    answers."""
    path, hf = tiny_model_dir("qwen3_5")
    prompt = _prompts(1, 15)[0]
    llm = LLM(path, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    assert _greedy(llm, [prompt], 8) == [_hf_greedy(hf, prompt, 8)]
