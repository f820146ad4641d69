"""Qwen3.5 (Qwen3_5ForCausalLM, and the language model of Qwen3_5ForConditionalGeneration) as transformers computes it:
Gated DeltaNet linear-attention layers beside output-gated full attention, 1 + weight norms, a quarter of each head
rotating; the engine keeps each sequence's linear-attention state in a slot (engine.state_cache)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import pytest
import torch
from safetensors import safe_open
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
    """N-gram speculation (and the single-sequence prefill graphs) turned off, with one log line naming it; prefix
    caching stays on, with a prefix state kept for each of the 64 sequences' slots; the KV cache holds only the
    full-attention layer (one of four)."""
    path, _ = tiny_model_dir("qwen3_5")
    with caplog.at_level("INFO", logger="radiance"):
        llm = LLM(path, device="cpu", dtype="float32", ngram_draft_tokens=4, enable_prefix_caching=True)
    config = llm.engine.config
    assert config.cache.enable_prefix_caching and config.speculative.ngram_draft_tokens == 0
    assert "n-gram speculative decoding off for this model" in caplog.text
    # the whole-step prefill graphs off (none could run the delta rule), the piecewise ones kept
    assert config.runner.prefill_graph_tokens == (0,) and config.runner.piecewise_graph_tokens is None
    assert llm.engine.runner.kv_cache.shape[1] == 1  # one layer slot per page
    assert "linear-attention states: 64 slots + 64 prefix states x 0.01 MiB (3 layers)" in llm.engine.load_summary[-1]
    prompt = _prompts(1, 100)[0]  # the same prompt twice: the second continues from the states at 64
    first, second = _greedy(llm, [prompt], 5), _greedy(llm, [prompt], 5)
    assert first == second and llm.engine.scheduler.prefix_cache_hits == 64


def test_overlapped_decode_never_discards_a_step_that_advanced_the_states(tiny_model_dir):
    """Decode steps queued ahead on a hybrid model: requests arriving while one is queued, one stopping on a token
    (not foreseen when its step was queued), different lengths, two slots for five requests. A queued step is
    taken, never discarded (it advanced the states: the engine would raise); every answer is transformers'."""
    path, hf = tiny_model_dir("qwen3_5")
    prompts = _prompts(5, 9, seed=13)
    want = [_hf_greedy(hf, p, 12) for p in prompts]
    stop = want[1][4]  # request 1 stops on its fifth token (or earlier, should the token come sooner)
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, overlap_decode=True)
    engine = llm.engine
    params = [SamplingParams(max_tokens=12 - i, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop] if i == 1 else None) for i in range(5)]
    got, pending = {}, list(range(5))
    engine.add_request("0", prompts[0], params[0])
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 3 == 0:  # arrivals between steps, with a step queued or not
            i = pending.pop(0)
            if str(i) not in engine.sequences and i:
                engine.add_request(str(i), prompts[i], params[i])
            pending = [j for j in pending if j != i]
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.token_ids
        steps += 1
    assert engine.overlapped_steps > 0
    for i in range(5):
        if i == 1:
            end = want[1].index(stop) + 1
            assert got[1] == want[1][:end]
        else:
            assert got[i] == want[i][:12 - i], i
    assert engine.block_manager.state_slots.num_free == 2


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
    """Every linear on MXFP4 at load (3 linear-attention layers x (in_proj_qkvz, in_proj_ba, out_proj), 1 x (qkv + o),
    4 x (gate_up + down)); the same logits, bit for bit, from what `radiance convert` wrote, which keeps the
    checkpoint's own four input projections."""
    path = str(tmp_path / "bf16")
    _rewrite(tiny_model_dir("qwen3_5")[0], path, lambda n: n)
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "linears: 19 mxfp4" in "\n".join(loaded.summary)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    at_load = loaded.model.forward_logits(ids)
    convert_checkpoint(path, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    written = {name for file in glob.glob(str(tmp_path / "mx" / "*.safetensors"))
               for name in safe_open(file, "pt").keys()}
    assert {n.split(".")[4] for n in written if n.startswith("model.layers.0.linear_attn.")} == {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d", "norm", "A_log", "dt_bias"}
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


@pytest.mark.parametrize("prefix_caching, seqs, prefix_states", [(True, 3, 3), (False, 6, 0)])
def test_max_num_seqs_is_lowered_to_the_states_that_fit(tiny_model_dir, caplog, prefix_caching, seqs, prefix_states):
    """Each sequence's states take 3 x (96 x 3 + 4 x 16 x 8) x 4 B = 9600 B in float32: half a CPU budget of 128 KiB
    (MAX_STATE_SHARE) holds 6. With prefix caching, the prefix states get half of them and max_num_seqs the rest
    (64 each asked for), else max_num_seqs all six; a warning names each one lowered, and the engine still serves
    more prompts than that (they wait their turn)."""
    path, hf = tiny_model_dir("qwen3_5")
    with caplog.at_level("WARNING", logger="radiance"):
        llm = LLM(path, device="cpu", dtype="float32", cpu_kv_cache_bytes=128 << 10, max_model_len=64,
                  enable_prefix_caching=prefix_caching)
    slots = llm.engine.block_manager.state_slots
    assert llm.engine.config.scheduler.max_num_seqs == seqs and slots.count == seqs
    assert llm.engine.config.cache.prefix_states == prefix_states
    assert (slots.prefix.count if slots.prefix is not None else 0) == prefix_states
    assert f"max_num_seqs lowered to {seqs} from 64" in caplog.text
    assert ("prefix_states lowered to 3 from 64" in caplog.text) == prefix_caching
    # the KV cache takes what the states leave of the budget: (131072 - 6 x 9600) // (16 tokens x 256 B) blocks
    assert llm.engine.runner.num_blocks == 17
    prompts = _prompts(9, 5, seed=11)
    assert _greedy(llm, prompts, 4) == [_hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.parametrize("model, tensor", [("qwen3_5_moe", "model.layers.2.linear_attn.in_proj_z.weight"),
                                           ("qwen3_5", "model.layers.1.linear_attn.in_proj_a.weight"),
                                           ("qwen3_5", "model.layers.0.linear_attn.in_proj_qkv.weight"),
                                           ("qwen3_next", "model.layers.2.linear_attn.in_proj_ba.weight")])
def test_a_missing_projection_is_named(tiny_model_dir, tmp_path, model, tensor):
    """A linear-attention projection missing from a Qwen3.5, Qwen3.5-MoE (no intermediate_size in its config) or
    Qwen3-Next checkpoint is named when the checkpoint opens: the part the checkpoint lacks, not the merged linear
    (in_proj_qkvz, in_proj_ba) it is served in."""
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


# ---------------------------------------------------------------- GGUF (llama.cpp's qwen35, qwen35moe, qwen3next)

def _periodic_hf_model(arch: str):
    """A tiny model whose attention layer is every second one (llama.cpp's files give a full_attention_interval, not
    a list), every MLP of the MoE ones sparse (llama.cpp reads no mlp_only_layers)."""
    from transformers import AutoModelForCausalLM

    from tests.engine.conftest import randomize, tiny_hf_model

    config = tiny_hf_model(arch).config
    config.layer_types = ["linear_attention", "full_attention"] * 2
    if arch == "qwen3_next":
        config.mlp_only_layers = []
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model)
    return model


def _llama_cpp_hybrid_tensors(hf, reorder: bool) -> dict:
    """The model's tensors as llama.cpp's Qwen3-Next / Qwen3.5 converter writes them: its names, norms but ssm_norm as
    1 + weight, ssm_a = -exp(A_log), the conv squeezed, Qwen3-Next's grouped in_proj_qkvz split into attn_qkv and
    attn_gate, and with `reorder` (Qwen3.5) the value heads tiled (file head j * key_heads + g = head g * r + j)."""
    from tests.engine.gguf_files import LLAMA_BLOCK, gguf_tensors

    c = hf.config
    nk, nv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    r, keys = nv // nk, 2 * nk * dk
    tiled = torch.tensor([(p % nk) * r + p // nk for p in range(nv)])  # file position p holds this head

    def tile(x, dim=0):
        return x.unflatten(dim, (nv, -1)).index_select(dim, tiled).flatten(dim, dim + 1) if reorder else x

    block = {**LLAMA_BLOCK, "post_attention_layernorm": "post_attention_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}
    state = {n: t for n, t in hf.state_dict().items() if ".linear_attn." not in n}
    plain = type("Plain", (), {"config": c, "state_dict": lambda self: state})()
    tensors = {n: v + 1.0 if n.endswith("norm.weight") else v for n, v in gguf_tensors(plain, block).items()}
    for i, layer in enumerate(hf.model.layers):
        la = getattr(layer, "linear_attn", None)
        if la is None:
            continue
        p = f"blk.{i}."
        if hasattr(la, "in_proj_qkvz"):  # Qwen3-Next: [q_g | k_g | v_g | z_g] per key head g
            q, k, v, z = la.in_proj_qkvz.weight.detach().unflatten(0, (nk, -1)).split((dk, dk, r * dv, r * dv), 1)
            qkv = torch.cat((q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)))
            gate = z.flatten(0, 1)
            tensors[p + "ssm_ba.weight"] = la.in_proj_ba.weight.detach().numpy()
        else:
            qkv, gate = la.in_proj_qkv.weight.detach(), la.in_proj_z.weight.detach()
            tensors[p + "ssm_beta.weight"] = tile(la.in_proj_b.weight.detach()).numpy()
            tensors[p + "ssm_alpha.weight"] = tile(la.in_proj_a.weight.detach()).numpy()
        tensors[p + "attn_qkv.weight"] = torch.cat((qkv[:keys], tile(qkv[keys:]))).numpy()
        tensors[p + "attn_gate.weight"] = tile(gate).numpy()
        conv = la.conv1d.weight.detach()[:, 0]
        tensors[p + "ssm_conv1d.weight"] = torch.cat((conv[:keys], tile(conv[keys:]))).numpy()
        tensors[p + "ssm_a"] = tile(-la.A_log.detach().float().exp()).numpy()
        tensors[p + "ssm_dt.bias"] = tile(la.dt_bias.detach()).numpy()
        tensors[p + "ssm_norm.weight"] = la.norm.weight.detach().numpy()  # the gated norm: not shifted
        tensors[p + "ssm_out.weight"] = tile(la.out_proj.weight.detach(), 1).numpy()
    return tensors


@pytest.mark.parametrize("model, arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe"),
                                         ("qwen3_next", "qwen3next")])
def test_a_llama_cpp_gguf_serves_transformers_logits(tmp_path, model, arch):
    """llama.cpp's qwen35 / qwen35moe / qwen3next files (their ssm.* sizes, full_attention_interval, the transforms
    its converter applies; qwen35's value heads tiled): transformers' logits. The qwen35 files' tiling matters: read
    as stored, the logits differ."""
    from radiance.checkpoint import gguf_arch
    from tests.engine.gguf_files import write_gguf

    hf = _periodic_hf_model(model)
    c = hf.config
    metadata = {f"{arch}.ssm.conv_kernel": 4, f"{arch}.ssm.state_size": 16, f"{arch}.ssm.group_count": 2,
                f"{arch}.ssm.time_step_rank": 4, f"{arch}.ssm.inner_size": 32, f"{arch}.full_attention_interval": 2,
                f"{arch}.rope.dimension_count": 4}
    if arch != "qwen35":
        metadata.update({f"{arch}.expert_count": 8, f"{arch}.expert_used_count": 2,
                         f"{arch}.expert_feed_forward_length": 32, f"{arch}.expert_shared_feed_forward_length": 48})
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, c, _llama_cpp_hybrid_tensors(hf, reorder=arch != "qwen3next"),
                      metadata, head_dim=16)
    ckpt = open_checkpoint(path)
    cls, cfg = resolve_architecture(ckpt.config)
    assert cfg.linear_layers == {0, 2} and cfg.rotary_dim == 4 and (cfg.moe is None) == (arch == "qwen35")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf(ids).logits
    got = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model.forward_logits(ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    if arch == "qwen35":  # without putting the value heads back in order
        untiled = dataclasses.replace(gguf_arch.ARCHITECTURES[arch], derived=gguf_arch._hybrid_derived(reorder=False))
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(gguf_arch.ARCHITECTURES, arch, untiled)
            wrong = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path),
                               progress=False).model.forward_logits(ids)
        assert ((wrong - want).norm() / want.norm()).item() > 1e-2


@pytest.mark.parametrize("model, served", [("qwen3_next", "linears: 6 dense, 61 mxfp4"),
                                           ("qwen3_5", "linears: 3 dense, 16 mxfp4")])
def test_an_nvfp4_checkpoint_serves_its_values(tiny_model_dir, tmp_path, model, served):
    """A compressed-tensors NVFP4 Qwen3-Next / Qwen3.5 (every linear but lm_head and the linear attention's small
    b / a projections, as exports leave them 16-bit): its linear-attention projections read as NVFP4 (Qwen3.5's
    in_proj_qkv and in_proj_z as one linear of two NVFP4 partitions, its 16-bit in_proj_b and in_proj_a as another);
    served 16-bit (quantization none) it gives, bit for bit, the logits of a dense checkpoint holding the dequantized
    values; served on MXFP4 (the default) it loads every quantized linear there."""
    from radiance.formats import Nvfp4Weight, dequantize
    from tests.checkpoint.factory import CT_NVFP4_CONFIG, ct_nvfp4_tensors

    path, _hf = tiny_model_dir(model)
    sd = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    # (the tiny shared expert's down_proj, K = 48, stays 16-bit too: MXFP4 blocks need K a multiple of 32)
    small = re.compile(r"in_proj_(ba|b|a)\.weight$")
    modules = [n[:-len(".weight")] for n in sd if n.endswith(("_proj.weight", "in_proj_qkvz.weight",
                                                              "in_proj_qkv.weight", "in_proj_z.weight"))
               and not small.search(n) and "shared_expert.down_proj" not in n]
    quantized = ct_nvfp4_tensors(sd, modules)
    nvfp4 = str(tmp_path / "nvfp4")
    os.makedirs(nvfp4)
    save_file(quantized, os.path.join(nvfp4, "model.safetensors"))
    with open(os.path.join(nvfp4, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=dict(CT_NVFP4_CONFIG, ignore=[
            "lm_head", "re:.*in_proj_(ba|b|a)$", "re:.*shared_expert.down_proj"])), f)
    ckpt = open_checkpoint(nvfp4)
    weights = dict(ckpt.iter_weights(progress=False))
    assert isinstance(weights["model.layers.0.linear_attn.in_proj_qkvz"], Nvfp4Weight)
    assert weights["model.layers.0.linear_attn.in_proj_ba"].format == "dense"
    if model == "qwen3_5":  # the parts keep their own global scales
        assert len(weights["model.layers.0.linear_attn.in_proj_qkvz"].partition_sizes) == 2
    dense = dict(sd)
    for m in modules:
        parts = {k.rpartition(".")[2]: v for k, v in quantized.items() if k.rpartition(".")[0] == m}
        dense[f"{m}.weight"] = dequantize(Nvfp4Weight(parts["weight_packed"], parts["weight_scale"],
                                                      parts["weight_global_scale"])).to(sd[f"{m}.weight"].dtype)
    _rewrite(path, str(tmp_path / "dense"), lambda n: n)
    save_file(dense, os.path.join(str(tmp_path / "dense"), "model.safetensors"))
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(9))
    assert torch.equal(_forward(nvfp4, ids, quantization="none"), _forward(str(tmp_path / "dense"), ids))
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16"), checkpoint=open_checkpoint(nvfp4), progress=False)
    summary = "\n".join(loaded.summary)
    # 3 x in_proj_ba (and Qwen3-Next's 3 shared down_proj) 16-bit; the rest requantized, the linear attention's
    # 3 x (qkvz + out) too
    assert served in summary and "in_proj_qkvz 3, out_proj 3" in summary
    assert torch.isfinite(loaded.model.forward_logits(ids)).all()


def test_ignoring_one_part_of_a_merged_projection_is_refused(tiny_model_dir):
    """in_proj_b and in_proj_a are served as one linear: an ignore pattern keeping only one of them 16-bit is a
    refused naming both (vLLM refuses it too); both together are kept 16-bit."""
    path, _ = tiny_model_dir("qwen3_5")
    with pytest.raises(ValueError, match=r"select in_proj_b but not in_proj_a of model\.layers\.0\.linear_attn"):
        load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4", ignore=(r"in_proj_b$",)),
                   checkpoint=open_checkpoint(path), progress=False)
    loaded = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4", ignore=(r"in_proj_[ba]$",)),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "linears: 3 dense, 16 mxfp4" in "\n".join(loaded.summary)


def _nvfp4_copy(path: str, out: str, modules: list[str], ignore: list[str]) -> dict:
    """The checkpoint at `path` with `modules` stored as compressed-tensors NVFP4 (the rest as they were); returns
    the dense state dict holding the NVFP4 values instead (what serving it 16-bit must equal)."""
    from radiance.formats import Nvfp4Weight, dequantize
    from tests.checkpoint.factory import CT_NVFP4_CONFIG, ct_nvfp4_tensors

    sd = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    quantized = ct_nvfp4_tensors(sd, modules)
    os.makedirs(out)
    save_file(quantized, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=dict(CT_NVFP4_CONFIG, ignore=ignore)), f)
    dense = dict(sd)
    for m in modules:
        parts = {k.rpartition(".")[2]: v for k, v in quantized.items() if k.rpartition(".")[0] == m}
        dense[f"{m}.weight"] = dequantize(Nvfp4Weight(parts["weight_packed"], parts["weight_scale"],
                                                      parts["weight_global_scale"])).to(sd[f"{m}.weight"].dtype)
    return dense


def test_a_pair_stored_in_two_formats_is_said_once_at_open_and_served_exactly(tiny_model_dir, tmp_path):
    """in_proj_qkv NVFP4 beside a 16-bit in_proj_z (one linear, one kernel): one warning at open naming the parts
    and their formats, listed by inspect too; served 16-bit in float32 the NVFP4 values exactly (the merge no
    longer rounds them through bfloat16)."""
    path, _ = tiny_model_dir("qwen3_5")
    sd = load_file(os.path.join(path, "model.safetensors"))
    modules = [n[:-len(".weight")] for n in sd if n.endswith("in_proj_qkv.weight")]
    dense = _nvfp4_copy(path, str(tmp_path / "mixed"), modules,
                        ["lm_head", "re:.*_proj$", "re:.*in_proj_[zba]$", "re:.*out_proj$"])
    ckpt = open_checkpoint(str(tmp_path / "mixed"))
    mixed = [w for w in ckpt.warnings if "different formats" in w]
    assert mixed == ["3 in_proj_qkvz linear(s) (e.g. model.layers.0.linear_attn.in_proj_qkvz) store their parts in "
                     "different formats (in_proj_qkv nvfp4, in_proj_z dense): served as one linear, each is read as "
                     "its 16-bit values"]
    _rewrite(path, str(tmp_path / "dense"), lambda n: n)
    save_file(dense, os.path.join(str(tmp_path / "dense"), "model.safetensors"))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_forward(str(tmp_path / "mixed"), ids, quantization="none"),
                       _forward(str(tmp_path / "dense"), ids))


@pytest.mark.parametrize("model, extra, named", [
    ("qwen3_5", {"model.layers.0.linear_attn.in_proj_qkvz.weight": (128, 64)}, "in_proj_qkvz is stored both whole"),
    ("qwen3_next", {"model.layers.0.linear_attn.in_proj_z.weight": (32, 64)}, "in_proj_qkvz is stored both whole"),
])
def test_a_linear_stored_both_whole_and_in_parts_is_refused(tiny_model_dir, tmp_path, model, extra, named):
    """Both spellings of one linear in a checkpoint: one would be served and the other silently ignored."""
    path, _ = tiny_model_dir(model)
    out = str(tmp_path / "dup")
    _rewrite(path, out, lambda n: n)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors.update({name: torch.randn(shape) for name, shape in extra.items()})
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=named) as info:
        open_checkpoint(out)
    assert "model.layers.0.linear_attn." in str(info.value)


def test_a_missing_quantized_projection_is_named_as_stored(tiny_model_dir, tmp_path):
    """An NVFP4 Qwen3-Next without layer 2's in_proj_ba: named by the tensor quantization_config says it stores
    (weight_packed), not a .weight it never had."""
    path, _ = tiny_model_dir("qwen3_next")
    sd = load_file(os.path.join(path, "model.safetensors"))
    modules = [n[:-len(".weight")] for n in sd if ".linear_attn.in_proj_" in n]
    out = str(tmp_path / "nvfp4")
    _nvfp4_copy(path, out, modules, ["lm_head", "re:.*_proj$"])
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.linear_attn.in_proj_ba.")}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.2\.linear_attn\.in_proj_ba\.weight_packed"):
        open_checkpoint(out)
