"""Numerics against transformers (the installed version): the rounding order of Gemma's and OLMo's RMSNorm in
bfloat16, OLMo 3's rope per layer type as transformers reads every form of its config.json, and Phi-3 LongRoPE's
factor set per served context."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.layers.norm import RMSNorm


def _load(path: str, dtype: str = "float32"):
    return load_model(ModelConfig(device="cpu", dtype=dtype), checkpoint=open_checkpoint(path), progress=False).model


def _hf(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# --- 1. RMSNorm's rounding order ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "olmo2", "olmo3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_norm_rounds_as_transformers(tiny_model_dir, arch, dtype):
    """transformers' Gemma3RMSNorm / Gemma2RMSNorm ((1 + w) in fp32) and Olmo2RMSNorm / Olmo3RMSNorm multiply the
    normalized row by the weight in fp32 and round once; radiance rounded first (Llama's order), and kept Gemma's 1 + w
    in bf16: a bf16 ulp apart on 26-36% of the elements. Every norm of the loaded model (layer norms, q / k norms, the
    final one) now gives transformers' bytes for the same input."""
    path, _ = tiny_model_dir(arch)
    hf, ours = _hf(path, dtype), _load(path, str(dtype).split(".")[1])
    norms = [(name, m) for name, m in ours.named_modules() if isinstance(m, RMSNorm)]
    assert len(norms) >= 5
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, norm in norms:
            x = (3 * torch.randn(2, 7, norm.weight.shape[0], generator=generator)).to(dtype)
            assert torch.equal(norm(x), hf.get_submodule(name)(x)), name


def test_olmo2_bf16_logits_are_transformers_bytes(tiny_model_dir):
    """OLMo 2 rotates and attends as transformers does in bf16 (cos / sin in fp32, causal SDPA): with the norms' order
    matched, the whole model's bf16 logits are transformers' (were 1.1e-2 apart, relative); fp32 ones too."""
    path, _ = tiny_model_dir("olmo2")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    for dtype in (torch.bfloat16, torch.float32):
        with torch.no_grad():
            ref = _hf(path, dtype)(ids).logits
        assert torch.equal(_load(path, str(dtype).split(".")[1]).forward_logits(ids), ref.float()), dtype


# --- 2. OLMo 3's rope per layer type -----------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
SLIDING = {"rope_type": "default", "rope_theta": 1e4}


def _with_rope(path: str, dst, rope: dict) -> str:
    """The checkpoint at `path` with config.json's rope keys replaced by `rope`."""
    shutil.copytree(path, dst)
    config = json.loads(open(f"{path}/config.json").read())
    for key in ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"):
        config.pop(key, None)
    open(f"{dst}/config.json", "w").write(json.dumps({**config, **rope}))
    return str(dst)


@pytest.mark.parametrize("arch, rope", [
    ("olmo3", {"rope_parameters": {"sliding_attention": SLIDING, "full_attention": {**YARN, "rope_theta": 1.5e5}}}),
    # OLMo 3's published form: transformers' Olmo3Config merges rope_scaling into the full layers' rope and gives the
    # sliding ones its default base (500000), not rope_theta
    ("olmo3", {"rope_theta": 1.5e5, "rope_scaling": {**YARN, "attention_factor": 1.2}}),
    # transformers reads YaRN's truncate at the top of rope_parameters, never per layer type: it truncates (was 13%)
    ("olmo3", {"rope_parameters": {"sliding_attention": SLIDING,
                                   "full_attention": {**YARN, "rope_theta": 1.5e5, "truncate": False}}}),
    ("olmo3", {"rope_theta": 1.5e5, "rope_scaling": {**YARN, "truncate": False}}),  # (was 14%)
    # nested, a top-level original_max_position_embeddings is not read (was: 8 x 8 = a 64-token context)
    ("olmo3", {"rope_theta": 1.5e5, "rope_scaling": YARN, "original_max_position_embeddings": 8}),
    ("gemma3", {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {**YARN, "truncate": False}}),
], ids=["nested", "flat", "nested-truncate-false", "flat-truncate-false", "top-level-original", "gemma3-flat-truncate"])
def test_rope_per_layer_type_as_transformers_reads_it(tiny_model_dir, tmp_path, arch, rope):
    """The sliding layers rotate with their plain rope, the full ones with YaRN, each as transformers reads the same
    config.json: fp32 logits past YaRN's original context."""
    path = _with_rope(tiny_model_dir(arch)[0], tmp_path / "m", rope)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _hf(path)(ids).logits
    assert _rel(_load(path).forward_logits(ids), ref) <= 1e-5


# --- 3. Phi-3 LongRoPE's factor set ------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, max_model_len, matches", [
    (20, 32, True),    # a context within the 32-token pretraining one: the short factors, as transformers
    (100, 512, True),  # a sequence past it: the long factors, as transformers
    (20, 512, False),  # served context past it: the long factors for every sequence (transformers: short here)
])
def test_longrope_factors_follow_the_served_context(tiny_model_dir, tokens, max_model_len, matches):
    """transformers picks per forward (max position + 1 > original: long, for every position of it); radiance per
    served context (max_model_len > original: long), vLLM's rule, so that a paged KV cache never holds keys rotated
    by both sets. Equal to transformers wherever the two rules agree, 30% apart where they do not."""
    path, hf = tiny_model_dir("phi3longrope")
    ours = _load(path)
    ours.model.rotary.serve_context(max_model_len)
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids).logits
    rel = _rel(ours.forward_logits(ids), ref)
    assert rel <= 1e-5 if matches else rel > 0.1, rel


def test_transformers_recomputes_a_phi3_sequence_when_it_passes_the_pretraining_context(tiny_model_dir):
    """Why no paged cache can follow transformers' generate exactly without a recompute: when a sequence first passes
    original_max_position_embeddings, Phi3ForCausalLM.prepare_inputs_for_generation drops the cache and re-runs the
    whole sequence with the long factors, so every step's logits are a fresh forward's over the whole sequence."""
    _, hf = tiny_model_dir("phi3longrope")
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        fresh = [hf(generated[:, :n]).logits[0, -1].argmax().item() for n in range(20, 36)]
    assert generated[0, 20:].tolist() == fresh


@pytest.mark.parametrize("tokens", [20, 100])
def test_eval_chunks_pick_longrope_factors_as_transformers(tiny_model_dir, tokens):
    """eval scores each chunk in one forward, as transformers does: its LongRoPE factors follow the chunk's length
    (a 20-token chunk of a 32-token pretraining context took the long factors of the model's whole context)."""
    from radiance.bench.quality import check_context

    path, hf = tiny_model_dir("phi3longrope")
    ours = _load(path)
    check_context(ours, tokens)
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(ours.forward_logits(ids), ref) <= 1e-5
