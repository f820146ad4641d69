"""What an adapter may hold: each refusal names the file (and the tensor where one is at fault); a checkpoint's fused
qkv_proj adapter splits into the q, k, v partitions; a LoraLinear on an MXFP4 base adds exactly the delta."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from radiance import LLM, LoRARequest, SamplingParams
from radiance.config import KernelConfig
from radiance.formats import DenseWeight
from radiance.layers.linear import Mxfp4Linear
from radiance.lora import LoraLinear, LoraStepContext, LoraTarget, load_adapter
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.lora.adapters import PEFT_PREFIX, adapter_tensors, write_adapter

FP32 = dict(TINY, torch_dtype="float32")
ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True)
Q0 = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_dir(str(tmp_path_factory.mktemp("base") / "m"), dense_state_dict(dtype=torch.float32), FP32)


@pytest.fixture(scope="module")
def llm(base_dir):
    return LLM(base_dir, enable_lora=True, max_lora_rank=8, **ENGINE)


def _tensors(**changes):
    tensors = adapter_tensors(4, seed=3, projections=("self_attn.q_proj", "mlp.down_proj"))
    tensors.update(changes)
    return tensors


BAD = {  # case -> (tensors, config changes, the message's words, the tensor it names or None)
    "rank above max_lora_rank": (adapter_tensors(16, seed=3, projections=("self_attn.q_proj",)), {"r": 16},
                                 "r is 16, above max_lora_rank 8", None),
    "dora": (_tensors(), {"use_dora": True}, "DoRA", None),
    "modules_to_save in the config": (_tensors(), {"modules_to_save": ["lm_head"]}, "modules_to_save", None),
    "modules_to_save weights": (_tensors(**{f"{PEFT_PREFIX}lm_head.modules_to_save.default.weight":
                                            torch.zeros(128, 64)}), {}, "modules_to_save",
                                f"{PEFT_PREFIX}lm_head.modules_to_save.default.weight"),
    "embedding lora": (_tensors(**{f"{PEFT_PREFIX}model.embed_tokens.lora_embedding_A": torch.zeros(4, 128)}),
                       {"target_modules": ["q_proj", "down_proj"]}, "embeddings or the lm_head", f"{PEFT_PREFIX}model.embed_tokens.lora_embedding_A"),
    "lm_head lora": (_tensors(**{f"{PEFT_PREFIX}lm_head.lora_A.weight": torch.zeros(4, 64),
                                 f"{PEFT_PREFIX}lm_head.lora_B.weight": torch.zeros(128, 4)}),
                     {"target_modules": ["q_proj", "down_proj"]}, "embeddings or the lm_head", f"{PEFT_PREFIX}lm_head.lora_A.weight"),
    "bias": (_tensors(), {"bias": "all"}, "only bias \"none\"", None),
    "embedding target": (_tensors(), {"target_modules": ["q_proj", "embed_tokens"]}, "embeddings or the lm_head", None),
    "fan_in_fan_out": (_tensors(), {"fan_in_fan_out": True}, "fan_in_fan_out", None),
    "a layer the model lacks": (_tensors(**{f"{PEFT_PREFIX}model.layers.5.self_attn.q_proj.lora_A.weight":
                                            torch.zeros(4, 64),
                                            f"{PEFT_PREFIX}model.layers.5.self_attn.q_proj.lora_B.weight":
                                            torch.zeros(64, 4)}), {}, "the model has no linear",
                                f"{PEFT_PREFIX}model.layers.5.self_attn.q_proj.lora_A.weight"),
    "moe experts": (_tensors(**{f"{PEFT_PREFIX}model.layers.0.mlp.experts.0.gate_proj.lora_A.weight":
                                torch.zeros(4, 64),
                                f"{PEFT_PREFIX}model.layers.0.mlp.experts.0.gate_proj.lora_B.weight":
                                torch.zeros(96, 4)}), {}, "MoE experts",
                    f"{PEFT_PREFIX}model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"),
    # Qwen3.5's in_proj_qkv: named as the adapter wrote it, not the merged in_proj_qkvz it is served in
    "linear attention": (_tensors(**{f"{PEFT_PREFIX}model.layers.0.linear_attn.in_proj_qkv.lora_A.weight":
                                     torch.zeros(4, 64),
                                     f"{PEFT_PREFIX}model.layers.0.linear_attn.in_proj_qkv.lora_B.weight":
                                     torch.zeros(96, 4)}), {}, r"linear-attention projections \(model\.layers\.0"
                         r"\.linear_attn\.in_proj_qkv\)",
                         f"{PEFT_PREFIX}model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"),
    "wrong shape": (_tensors(**{f"{Q0}.lora_B.weight": torch.zeros(32, 4)}), {}, r"shape \(32, 4\), expected \(64, 4\)",
                    f"{Q0}.lora_B.weight"),
    "nan": (_tensors(**{f"{Q0}.lora_A.weight": torch.full((4, 64), float("nan"))}), {}, "NaN or inf",
            f"{Q0}.lora_A.weight"),
    "half a pair": ({f"{Q0}.lora_A.weight": torch.zeros(4, 64)}, {}, "its lora_B is missing", f"{Q0}.lora_A.weight"),
    "a bias tensor": (_tensors(**{f"{Q0}.lora_B.bias": torch.zeros(64)}), {}, "not a LoRA weight",
                      f"{Q0}.lora_B.bias"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_adapter_that_cannot_be_served_is_refused_naming_file_and_tensor(llm, tmp_path, case):
    tensors, config, words, tensor = BAD[case]
    config = dict(config)
    path = write_adapter(tmp_path / "bad", tensors, config.pop("r", 4), 8.0, **config)
    with pytest.raises(ValueError, match=words) as info:
        llm.engine.add_lora(LoRARequest("bad", 1, path))
    message = str(info.value)
    assert path in message
    if tensor is not None:
        assert f"tensor {tensor}:" in message
    assert llm.engine.list_loras() == []


def test_pickled_weights_and_missing_files_are_refused(llm, tmp_path):
    path = write_adapter(tmp_path / "bin", _tensors(), 4, 8.0)
    os.replace(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin"))
    with pytest.raises(ValueError, match=r"adapter_model\.bin: pickled weights .* adapter_model\.safetensors"):
        llm.engine.add_lora(LoRARequest("bin", 1, path))
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.add_lora(LoRARequest("bin", 1, path))
    with pytest.raises(ValueError, match="no such adapter directory"):
        llm.engine.add_lora(LoRARequest("x", 1, str(tmp_path / "absent")))
    os.replace(os.path.join(path, "adapter_model.bin"), os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as handle:
        json.dump({"peft_type": "PREFIX_TUNING"}, handle)
    with pytest.raises(ValueError, match="only LoRA adapters"):
        llm.engine.add_lora(LoRARequest("bin", 1, path))


def test_a_fused_qkv_adapter_splits_into_the_partitions(tmp_path):
    """Phi-3 stores qkv_proj fused: one A for all three, B [q + k + v, r] split by the partitions."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(128, 4, generator=gen)
    module = f"{PEFT_PREFIX}model.layers.0.self_attn.qkv_proj"
    path = write_adapter(tmp_path / "fused", {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}, 4, 4.0)
    targets = {"model.layers.0.self_attn.qkv_proj": LoraTarget(64, (64, 32, 32))}
    adapter = load_adapter(LoRARequest("f", 1, path), targets, max_rank=8)
    parts = adapter.weights["model.layers.0.self_attn.qkv_proj"]
    assert all(torch.equal(part[0], a) for part in parts)
    assert torch.equal(torch.cat([part[1] for part in parts]), b)  # scale alpha / r = 1


def test_a_lora_linear_on_an_mxfp4_base_adds_exactly_the_delta():
    """Rows of slot 1 get base(x) + x A^T B^T of their adapter (per partition), rows without an adapter base(x)."""
    gen = torch.Generator().manual_seed(0)
    base, _ = Mxfp4Linear.from_weight(DenseWeight(torch.randn(96, 64, generator=gen)), kernel_config=KernelConfig())
    context = LoraStepContext()
    context.allocate(8, torch.device("cpu"))
    layer = LoraLinear(base, (64, 32), context, max_loras=2, max_rank=4, dtype=torch.float32,
                       device=torch.device("cpu"))
    parts = [(torch.randn(3, 64, generator=gen), torch.randn(64, 3, generator=gen)),
             (torch.randn(2, 64, generator=gen), torch.randn(32, 2, generator=gen))]
    layer.set_slot(1, parts)
    x = torch.randn(5, 64, generator=gen)
    import numpy as np
    context.begin_step(np.array([1, -1, 1, 0, -1]))
    out = layer(x)
    context.end_step()
    delta = torch.cat([x @ a.t() @ b.t() for a, b in parts], dim=-1)
    reference = base(x)
    assert torch.allclose(out[[0, 2]], reference[[0, 2]] + delta[[0, 2]], atol=1e-4)
    assert torch.equal(out[[1, 3, 4]], reference[[1, 3, 4]])  # slot 0 is empty, -1 is the base
    assert torch.equal(layer(x), reference)  # outside a step with adapters: the base alone


class PlusDelta(torch.nn.Module):
    """A linear plus x A^T B^T per partition (a plain module: the model calls it, not a fused path)."""

    def __init__(self, base, pairs):
        super().__init__()
        self.base, self.pairs = base, pairs

    def forward(self, x):
        return self.base(x) + torch.cat([x @ a.t() @ b.t() for a, b in self.pairs], dim=-1)


def test_an_mxfp4_base_serves_the_reference_plus_the_exact_delta(base_dir, tmp_path):
    """The engine on an MXFP4 base (quantization mxfp4) with an adapter scores a prompt as the MXFP4 model without
    LoRA does with each linear's delta added by a hook."""
    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    tensors = adapter_tensors(4, seed=5)
    path = write_adapter(tmp_path / "ad", tensors, 4, 8.0)
    llm = LLM(base_dir, quantization="mxfp4", enable_lora=True, max_lora_rank=4, **ENGINE)
    prompt = [5, 9, 23, 7, 41, 3, 17, 88, 12, 60]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False,
                       lora_request=LoRARequest("ad", 1, path))[0]
    ours = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]

    reference = load_model(ModelConfig(model=base_dir, quantization="mxfp4", device="cpu", dtype="float32"),
                           checkpoint=open_checkpoint(base_dir), progress=False).model
    groups = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    for name, module in list(reference.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in groups:
            parent = name.rpartition(".")[0]
            pairs = [(tensors[f"{PEFT_PREFIX}{parent}.{p}.lora_A.weight"],
                      tensors[f"{PEFT_PREFIX}{parent}.{p}.lora_B.weight"] * 2.0) for p in groups[leaf]]
            setattr(reference.get_submodule(parent), leaf, PlusDelta(module, pairs))
    logits = reference.forward_logits(torch.tensor([prompt]))[0].log_softmax(-1)
    expected = [logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert ours == pytest.approx(expected, abs=2e-4)


def test_the_async_engine_adds_serves_and_removes_adapters(base_dir, tmp_path):
    from radiance.engine.async_engine import AsyncLLMEngine

    path = write_adapter(tmp_path / "ad", adapter_tensors(4, seed=6), 4, 8.0)
    llm = LLM(base_dir, enable_lora=True, max_lora_rank=4, **ENGINE)
    engine = AsyncLLMEngine(engine=llm.engine)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = [5, 9, 23, 7, 41, 3]
    expected = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("x", 9, path))[0]
    llm.engine.remove_lora(9)

    async def run():
        assert await engine.add_lora(LoRARequest("ad", 1, path)) is True
        assert await engine.add_lora(LoRARequest("ad", 1, path)) is False
        last = None
        async for out in engine.generate("r1", prompt, params, lora_request=LoRARequest("ad", 1)):
            last = out
        with pytest.raises(ValueError, match="not loaded"):
            async for _ in engine.generate("r2", prompt, params, lora_request=LoRARequest("other", 2)):
                pass
        assert [r.lora_name for r in engine.list_loras()] == ["ad"]
        assert await engine.remove_lora(1) is True
        assert await engine.remove_lora(1) is False
        await engine.shutdown()
        return last

    last = asyncio.run(run())
    assert last.token_ids == expected.outputs[0].token_ids
