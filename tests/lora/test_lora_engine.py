"""LoRA adapters on a tiny fp32 Llama: an adapter serves the logits of the merged weights W + scale * B @ A, adapters
and the base mix in one step, max_loras bounds a step's adapters, the prefix cache keeps adapters apart."""

from __future__ import annotations

import math

import pytest
import torch

from radiance import LLM, LoRARequest, SamplingParams
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.lora.adapters import adapter_tensors, merged_state_dict, write_adapter

FP32 = dict(TINY, torch_dtype="float32")
ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True)
PROMPT = [5, 9, 23, 7, 41, 3, 17, 88, 12, 60, 31, 4, 99, 15, 72, 8, 44, 19, 27, 6]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
A1 = dict(rank=4, alpha=8.0)
A2 = dict(rank=8, alpha=12.0)  # use_rslora: scale alpha / sqrt(r)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = dense_state_dict(dtype=torch.float32)
    one, two = adapter_tensors(A1["rank"], seed=1), adapter_tensors(A2["rank"], seed=2)
    paths = {"base": write_dir(str(root / "base"), base, FP32),
             "a1": write_adapter(root / "a1", one, A1["rank"], A1["alpha"]),
             "a2": write_adapter(root / "a2", two, A2["rank"], A2["alpha"], use_rslora=True),
             "merged1": write_dir(str(root / "merged1"), merged_state_dict(base, one, **A1), FP32),
             "merged2": write_dir(str(root / "merged2"),
                                  merged_state_dict(base, two, A2["rank"], A2["alpha"], rslora=True), FP32)}
    return paths


@pytest.fixture(scope="module")
def lora_llm(models):
    return LLM(models["base"], enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)


@pytest.fixture(scope="module")
def merged(models):
    return {name: LLM(models[name], **ENGINE) for name in ("base", "merged1", "merged2")}


def request(models, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, models[name])


def prompt_scores(llm, lora=None) -> list[float]:
    out = llm.generate([PROMPT], SCORE, use_tqdm=False, lora_request=lora)[0]
    return [next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    return output.token_ids, [next(iter(entry.values())).logprob for entry in output.logprobs]


@pytest.mark.parametrize("adapter,reference", [("a1", "merged1"), ("a2", "merged2")])
def test_an_adapter_scores_as_the_merged_weights(models, lora_llm, merged, adapter, reference):
    """Every prompt position's logprob equals the merged model's (A1: alpha / r; A2: rslora's alpha / sqrt(r)),
    and differs from the base's."""
    ours = prompt_scores(lora_llm, request(models, adapter, 1 if adapter == "a1" else 2))
    assert ours == pytest.approx(prompt_scores(merged[reference]), abs=2e-4)
    assert max(abs(a - b) for a, b in zip(ours, prompt_scores(merged["base"]))) > 0.05


def test_adapters_and_the_base_mixed_in_one_step_each_match_their_solo_runs(models, lora_llm, merged):
    loras = [request(models, "a1", 1), None, request(models, "a2", 2)]
    steps = []
    original = lora_llm.engine.runner.launch

    def counting(scheduled, *args, **kwargs):
        steps.append({s.seq.lora_int_id for s in scheduled})
        return original(scheduled, *args, **kwargs)

    lora_llm.engine.runner.launch = counting
    try:
        outs = lora_llm.generate([PROMPT, PROMPT[:13], PROMPT[3:]], GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        del lora_llm.engine.runner.launch
    assert {1, 2, 0} in steps  # the three ran together
    for out, prompt, ref in zip(outs, (PROMPT, PROMPT[:13], PROMPT[3:]), ("merged1", "base", "merged2")):
        solo = merged[ref].generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        ids, logprobs = tokens_and_logprobs(out.outputs[0])
        assert ids == solo.token_ids
        assert logprobs == pytest.approx(tokens_and_logprobs(solo)[1], abs=2e-4)


def test_max_loras_1_runs_two_adapters_one_after_the_other(models, merged):
    llm = LLM(models["base"], enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    steps = []
    original = llm.engine.runner.launch

    def counting(scheduled, *args, **kwargs):
        steps.append({s.seq.lora_int_id for s in scheduled} - {0})
        return original(scheduled, *args, **kwargs)

    llm.engine.runner.launch = counting
    loras = [request(models, "a1", 1), request(models, "a2", 2), None, request(models, "a1", 1)]
    outs = llm.generate([PROMPT, PROMPT, PROMPT, PROMPT[2:]], GREEDY, use_tqdm=False, lora_request=loras)
    assert max(len(adapters) for adapters in steps) == 1 and {1} in steps and {2} in steps
    for out, prompt, ref in zip(outs, (PROMPT, PROMPT, PROMPT, PROMPT[2:]), ("merged1", "merged2", "base", "merged1")):
        assert out.outputs[0].token_ids == merged[ref].generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(llm.engine.lora.loaded) <= 1 or llm.engine.lora.max_cpu_loras >= len(llm.engine.lora.loaded)


def test_prefix_cache_blocks_are_not_shared_across_adapters(models, lora_llm):
    prompt = [3 + (7 * i) % 120 for i in range(50)]  # 3 full blocks of 16, its own
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(lora):
        return lora_llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    one, two = request(models, "a1", 1), request(models, "a2", 2)
    assert cached(None) == 0
    assert cached(one) == 0  # the base's blocks do not serve the adapter
    assert cached(one) == 48  # its own do
    assert cached(two) == 0
    assert cached(None) == 48


def test_lora_request_without_enable_lora_is_refused(models, merged):
    with pytest.raises(ValueError, match="lora_request must be None unless LoRA is enabled"):
        merged["base"].generate([PROMPT], GREEDY, use_tqdm=False, lora_request=request(models, "a1", 1))
    with pytest.raises(ValueError, match="not enabled"):
        merged["base"].engine.add_lora(request(models, "a1", 1))
    assert not merged["base"].engine.has_unfinished_requests()


def test_generate_checks_the_lora_request_list(models, lora_llm):
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        lora_llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[request(models, "a1", 1)])
    with pytest.raises(ValueError, match="a LoRARequest or a list"):
        lora_llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request="a1")
    with pytest.raises(ValueError, match="not loaded, and the request gives no lora_path"):
        lora_llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("nope", 77))
    assert not lora_llm.engine.has_unfinished_requests()


def test_add_remove_and_list_loras(models):
    llm = LLM(models["base"], enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
              lora_modules=(f"first={models['a1']}",), **ENGINE)
    engine = llm.engine
    assert engine.lora_enabled
    assert engine.list_loras() == [LoRARequest("first", 1, models["a1"])]
    assert engine.add_lora(LoRARequest("second", 2, models["a2"])) is True
    assert engine.add_lora(LoRARequest("second", 2, models["a2"])) is False
    assert [r.lora_int_id for r in engine.list_loras()] == [1, 2]
    assert len(engine.lora.loaded) == 1  # max_cpu_loras: the older one dropped from memory, still listed
    by_id = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("first", 1))[0]  # read again
    assert by_id.outputs[0].token_ids == llm.generate([PROMPT], GREEDY, use_tqdm=False,
                                                      lora_request=request(models, "a1", 1))[0].outputs[0].token_ids
    assert engine.remove_lora(2) is True and engine.remove_lora(2) is False
    assert [r.lora_int_id for r in engine.list_loras()] == [1]
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("second", 2))


def test_the_rslora_scale_is_alpha_over_sqrt_r(models, lora_llm):
    """The B the engine holds is the file's B times alpha / sqrt(r) (not alpha / r)."""
    from safetensors.torch import load_file

    stored = load_file(f"{models['a2']}/adapter_model.safetensors")
    adapter = lora_llm.engine.lora.load(request(models, "a2", 2))
    _, b = adapter.weights["model.layers.0.self_attn.o_proj"][0]
    expected = stored["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"] * (A2["alpha"] / math.sqrt(8))
    assert torch.allclose(b, expected)


def test_stats_name_the_adapters_of_running_and_waiting_requests(lora_llm, models):
    """What /metrics' lora_requests_info reports: max_loras and the adapters of waiting, then running requests."""
    engine = lora_llm.engine
    assert engine.stats().max_lora == 2
    for i, lora in enumerate((request(models, "a1", 1), None, request(models, "a2", 2), request(models, "a1", 1))):
        engine.add_request(f"stats{i}", PROMPT[:5 + i], SamplingParams(max_tokens=2), lora_request=lora)
    stats = engine.stats()
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters) == (("a1", "a2"), ())
    engine.step()
    stats = engine.stats()
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters) == ((), ("a1", "a2"))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert (stats.waiting_lora_adapters, stats.running_lora_adapters) == ((), ())


def test_stats_without_lora_have_no_max_lora(merged):
    assert merged["base"].engine.stats().max_lora is None
