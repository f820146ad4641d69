"""LoRA adapters on the GPU (run with -m gpu): CUDA graphs (decode, single-prefill and piecewise) replay the adapters'
deltas from the slots each step writes, so graphs give the eager tokens for batches mixing adapters and the base
(decode steps without an adapter replay a second set, captured without the deltas, with the LoRA-off tokens); a
W4A8 base takes adapters with the fp8 activations its norms hand it (the LoRA kernels read them too); the GPU serves
the merged weights' tokens."""

from __future__ import annotations

import pytest
import torch

from radiance import LLM, LoRARequest, SamplingParams
from radiance.layers.linear import takes_fp8
from radiance.lora import LoraLinear
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.engine.arrivals import staggered_outputs
from tests.lora.adapters import adapter_tensors, merged_state_dict, write_adapter

pytestmark = pytest.mark.gpu

FP32 = dict(TINY, torch_dtype="float32")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=4, cuda_graph_max_batch=4,
              max_num_batched_tokens=48)
PROMPTS = [[(3 * i + 7 * j) % 128 for j in range(n)] for i, n in enumerate((5, 13, 30, 21, 70, 9))]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_lora")
    base = dense_state_dict(dtype=torch.float32)
    one, two = adapter_tensors(4, seed=1), adapter_tensors(8, seed=2)
    return {"base": write_dir(str(root / "base"), base, FP32),
            "a1": write_adapter(root / "a1", one, 4, 8.0),
            "a2": write_adapter(root / "a2", two, 8, 12.0),
            "merged1": write_dir(str(root / "merged1"), merged_state_dict(base, one, 4, 8.0), FP32)}


def lora_llm(paths, **options) -> LLM:
    return LLM(paths["base"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               **dict(COMMON, **options))


def mixed_requests(paths) -> list:
    a1, a2 = LoRARequest("a1", 1, paths["a1"]), LoRARequest("a2", 2, paths["a2"])
    return [(a1, a2, None)[i % 3] for i in range(len(PROMPTS))]


def tokens(llm, prompts, lora) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_graphs_replay_mixed_adapters_as_eager_steps(paths, quantization):
    eager = lora_llm(paths, enforce_eager=True, quantization=quantization)
    graphs = lora_llm(paths, enforce_eager=False, prefill_graph_tokens=(16, 32), piecewise_graph_tokens=(16, 32),
                      quantization=quantization)
    runner = graphs.engine.runner
    assert runner.decode_graphs.graphs and runner.prefill_graphs.graphs and runner.piecewise.forwards
    wrappers = [m for m in graphs.engine.model.modules() if isinstance(m, LoraLinear)]
    assert wrappers and all(m.context.fused for m in wrappers)  # the deltas on the LoRA kernels
    # a W4A8 base keeps the fp8 hand-off of its norms and GLU multiply (the shrink reads the e4m3 codes)
    assert all(takes_fp8(m) == (quantization == "mxfp4") for m in wrappers)
    loras = mixed_requests(paths)
    # several prompts at once (piecewise prefill steps, then decode graphs of mixed slots)
    together = tokens(graphs, PROMPTS[:4], loras[:4])
    assert together == tokens(eager, PROMPTS[:4], loras[:4])
    # one at a time: single-sequence prefill graphs, each with its adapter
    for prompt, lora in zip(PROMPTS[:3], loras[:3]):
        assert tokens(graphs, [prompt], lora) == tokens(eager, [prompt], lora)
    # arrivals while others decode: prefill chunks next to decodes
    assert (staggered_outputs(graphs, PROMPTS, GREEDY, loras=loras)
            == staggered_outputs(eager, PROMPTS, GREEDY, loras=loras))
    # the adapters change what the base says
    base = tokens(eager, PROMPTS[:2], None)
    assert tokens(eager, PROMPTS[:2], loras[0]) != base
    # decode steps without an adapter replay the graphs captured without the deltas, steps with one the others
    replays = count_decode_replays(runner)
    assert tokens(graphs, PROMPTS[:2], None) == base == tokens(plain_llm(paths, quantization), PROMPTS[:2], None)
    assert replays["base"] > 0 and replays["lora"] == 0
    tokens(graphs, PROMPTS[:2], [loras[0], None])
    assert replays["lora"] > 0


def plain_llm(paths, quantization) -> LLM:
    return LLM(paths["base"], dtype="float32", enforce_eager=False, quantization=quantization, **COMMON)


def count_decode_replays(runner) -> dict[str, int]:
    """Counts the replays of the runner's two decode graph sets from now on."""
    counts = {"base": 0, "lora": 0}
    for key, graphs in (("base", runner.base_decode_graphs), ("lora", runner.decode_graphs)):
        def counted(*args, _replay=graphs.replay, _key=key):
            counts[_key] += 1
            return _replay(*args)
        graphs.replay = counted
    return counts


def test_gpu_adapter_gives_the_merged_models_tokens(paths):
    merged = LLM(paths["merged1"], dtype="float32", enforce_eager=False, **COMMON)
    graphs = lora_llm(paths, enforce_eager=False)
    a1 = LoRARequest("a1", 1, paths["a1"])
    assert tokens(graphs, PROMPTS[:4], a1) == tokens(merged, PROMPTS[:4], None)


def test_a_lora_linear_on_a_w4a8_base_given_fp8_activations():
    """Given fp8 activations (takes_fp8: the LoRA kernels read them), the wrapper's delta reads the values its W4A8
    base multiplied (x_q * x_scale): rows of slot 1 get it, rows without an adapter get the base alone."""
    import numpy as np

    from radiance.config import KernelConfig
    from radiance.formats import DenseWeight
    from radiance.kernels.activation import Fp8Activations, quantize_activations
    from radiance.layers.linear import Mxfp4Linear
    from radiance.lora import LoraStepContext

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    base, _ = Mxfp4Linear.from_weight(DenseWeight(torch.randn(96, 128, generator=gen).to(cuda)),
                                      kernel_config=KernelConfig())
    context = LoraStepContext(torch.bfloat16)
    context.allocate(8, cuda)
    layer = LoraLinear(base, (64, 32), context, max_loras=2, max_rank=4, dtype=torch.bfloat16, device=cuda)
    assert layer.fuses_glu() == base.fuses_glu() and takes_fp8(layer) and context.fused  # no adapter: the base's
    parts = [(torch.randn(3, 128, generator=gen), torch.randn(64, 3, generator=gen)),
             (torch.randn(2, 128, generator=gen), torch.randn(32, 2, generator=gen))]
    layer.set_slot(1, [(a.to(cuda, torch.bfloat16), b.to(cuda, torch.bfloat16)) for a, b in parts])
    x = torch.randn(5, 128, generator=gen).to(cuda, torch.bfloat16)
    x_q, x_scale = quantize_activations(x)
    fp8 = Fp8Activations(x_q, x_scale, torch.bfloat16, (5,))
    context.begin_step(np.array([1, -1, 1, 0, -1]))
    assert not layer.fuses_glu()  # the delta joins the output before any activation
    out = layer(fp8).float()
    context.end_step()
    seen = x_q.float() * x_scale
    delta = torch.cat([seen @ a.to(cuda).t() @ b.to(cuda).t() for a, b in parts], dim=-1)
    reference = base(fp8).float()
    rel = (out[[0, 2]] - reference[[0, 2]] - delta[[0, 2]]).norm() / delta[[0, 2]].norm()
    assert rel < 2e-2, rel  # bf16 adapter weights and outputs
    assert torch.equal(out[[1, 3, 4]], reference[[1, 3, 4]])
