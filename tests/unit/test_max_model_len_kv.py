"""max_model_len against the KV cache's capacity (blocks x block_size tokens): one set explicitly above it is
refused, as vLLM refuses it ("The model's max seq len (X) is larger than the maximum number of tokens that can be
stored in KV cache (Y)"), with one line naming both numbers and the settings that raise the capacity; it was
lowered with a warning. Not set (None: the model's context), it is still lowered with the warning, so a bare
`radiance serve` keeps running on a small machine."""

import logging

import pytest

from radiance import SamplingParams
from radiance.bench.synthetic import SyntheticCheckpoint
from radiance.config import EngineConfig
from radiance.engine.llm import LLM
from radiance.errors import ConfigError
from tests.bench.test_bench_synthetic import TINY

MODEL = "synthetic:llama-3.1-8b"
CONTEXT = 256
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads, head_dim 16, float32 on the CPU, 16 tokens


def _checkpoint() -> SyntheticCheckpoint:
    import torch

    return SyntheticCheckpoint(MODEL, device="cpu", dtype=torch.float32,
                               overrides={**TINY, "max_position_embeddings": CONTEXT})


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_an_explicit_length_above_the_block_override_is_refused():
    with pytest.raises(ConfigError) as err:
        LLM(MODEL, checkpoint=_checkpoint(), device="cpu", max_model_len=65, num_gpu_blocks_override=4)
    message = _one_line(err)
    assert "max_model_len 65 is larger than the KV cache holds: 64 tokens (4 blocks of 16)" in message, message
    assert "--num-gpu-blocks-override (now 4)" in message and "--max-model-len 64 or less" in message, message


def test_an_explicit_length_above_the_cpu_budget_is_refused_naming_the_budget():
    config = EngineConfig.from_flat(model=MODEL, device="cpu", max_model_len=CONTEXT,
                                    cpu_kv_cache_bytes=4 * BLOCK_BYTES)
    with pytest.raises(ConfigError) as err:
        LLM.from_engine_config(config, checkpoint=_checkpoint())
    message = _one_line(err)
    assert f"max_model_len {CONTEXT} is larger than the KV cache holds: 64 tokens (4 blocks of 16)" in message
    assert f"--cpu-kv-cache-bytes (now {4 * BLOCK_BYTES})" in message and "--kv-cache-dtype fp8" in message, message


def test_an_explicit_length_at_the_capacity_is_served():
    llm = LLM(MODEL, checkpoint=_checkpoint(), device="cpu", max_model_len=64, num_gpu_blocks_override=4)
    assert llm.engine.max_model_len == 64
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_an_unset_length_is_lowered_to_the_capacity_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(MODEL, checkpoint=_checkpoint(), device="cpu", num_gpu_blocks_override=4)
    assert llm.engine.max_model_len == 64
    assert any("max_model_len lowered to 64" in r.getMessage() for r in caplog.records), caplog.text


def test_an_unset_length_within_the_capacity_is_the_context(caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(MODEL, checkpoint=_checkpoint(), device="cpu", num_gpu_blocks_override=64)
    assert llm.engine.max_model_len == CONTEXT
    assert not any("lowered" in r.getMessage() for r in caplog.records)


def test_generate_refuses_an_explicit_length_above_the_kv_cache_in_one_line(capsys):
    from radiance.cli import main

    assert main(["generate", "hi", "--no-chat", "--max-tokens", "1", "--max-model-len", "64",
                 "--num-gpu-blocks-override", "2", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    errors = [line for line in captured.err.splitlines() if "error:" in line]  # the load's progress bar before it
    assert len(errors) == 1, captured.err
    assert "radiance generate: error: max_model_len 64 is larger than the KV cache holds: 32 tokens " \
           "(2 blocks of 16)" in errors[0], errors[0]


@pytest.mark.parametrize("knob", [{"num_gpu_blocks_override": 4}, {"cpu_kv_cache_bytes": 4 * BLOCK_BYTES}])
def test_a_capacity_known_without_weights_refuses_before_the_load(knob):
    """The CPU's byte budget and a block override give the block count from the config alone: the refusal comes
    before any weight is read (on CUDA without an override the count needs the loaded model's memory)."""
    ckpt = _checkpoint()
    read = []
    ckpt.iter_weights = lambda *a, **kw: read.append(1) or iter(())
    config = EngineConfig.from_flat(model=MODEL, device="cpu", max_model_len=65, **knob)
    with pytest.raises(ConfigError, match="max_model_len 65 is larger than the KV cache holds: 64 tokens"):
        LLM.from_engine_config(config, checkpoint=ckpt)
    assert not read
