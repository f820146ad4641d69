"""Every architecture family serves through the LoRA wrappers: with LoRA on and no adapter asked for, the tokens are
the base's (the wrappers take the 16-bit path, not the fused fp8 ones); an attention adapter changes them."""

from __future__ import annotations

import pytest
import torch

from radiance import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import PEFT_PREFIX, write_adapter

ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True)
PROMPT = [5, 9, 23, 7, 41, 3, 17, 88, 12, 60, 31, 4]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "gptoss", "granite", "qwen3moe"])
def test_lora_on_serves_the_base_and_an_attention_adapter(tiny_arch_dir, tmp_path, arch):
    path = tiny_arch_dir(arch)
    plain = LLM(path, **ENGINE).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, enable_lora=True, max_lora_rank=4, **ENGINE)
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == plain
    cfg = llm.engine.model.config
    gen = torch.Generator().manual_seed(0)
    module = f"{PEFT_PREFIX}model.layers.0.self_attn"
    tensors = {f"{module}.o_proj.lora_A.weight": torch.randn(4, cfg.q_size, generator=gen),
               f"{module}.o_proj.lora_B.weight": torch.randn(cfg.hidden_size, 4, generator=gen),
               f"{module}.q_proj.lora_A.weight": torch.randn(4, cfg.hidden_size, generator=gen),
               f"{module}.q_proj.lora_B.weight": torch.randn(cfg.q_size, 4, generator=gen)}
    adapter = write_adapter(tmp_path / "ad", tensors, 4, 64.0)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("ad", 1, adapter))[0]
    assert out.outputs[0].token_ids != plain


def test_llama4_adapter_on_reordered_q_k_rows_equals_its_merged_weights(tiny_arch_dir, tmp_path):
    """Llama 4 reorders each head's q / k rows at load (interleaved rotary pairs -> halves): an adapter's B rows for
    q_proj and k_proj (given apart, and fused for the unrotated v) are reordered with them, so its logits equal
    those of the checkpoint with W + scale * B @ A merged in."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model
    from tests.lora.adapters import merged_state_dict

    path = tiny_arch_dir("llama4")
    llm = LLM(path, enable_lora=True, max_lora_rank=4, **ENGINE)
    cfg = llm.engine.model.config
    gen = torch.Generator().manual_seed(1)
    module = "model.layers.0.self_attn"  # a rotating, chunked layer
    tensors = {}
    for proj, rows in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size)):
        tensors[f"{PEFT_PREFIX}{module}.{proj}.lora_A.weight"] = torch.randn(4, cfg.hidden_size, generator=gen)
        tensors[f"{PEFT_PREFIX}{module}.{proj}.lora_B.weight"] = 0.3 * torch.randn(rows, 4, generator=gen)
    adapter = write_adapter(tmp_path / "ad", tensors, 4, 8.0)
    prompt = [(3 * j + 1) % 256 for j in range(30)]  # past the 16-token chunk
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("ad", 1, adapter))[0].outputs[0]

    merged_dir = tmp_path / "merged"
    shutil.copytree(path, merged_dir)
    base = load_file(os.path.join(path, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in merged_state_dict(base, tensors, 4, 8.0).items()},
              str(merged_dir / "model.safetensors"))
    want = LLM(str(merged_dir), **ENGINE).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want.token_ids
    for got, ref in zip(out.logprobs, want.logprobs):
        for token, lp in ref.items():
            assert abs(got[token].logprob - lp.logprob) < 1e-4
    assert load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(str(merged_dir)),
                      progress=False)  # the merged copy is a servable checkpoint of its own
