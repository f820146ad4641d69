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
