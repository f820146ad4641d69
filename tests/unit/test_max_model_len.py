"""max_model_len above the model's context is refused, as vLLM refuses it (config.py `_get_and_verify_max_len`),
as soon as the config is read; it was lowered to the context with a warning that scrolled away behind the load."""

import pytest

from radiance.bench.synthetic import SyntheticCheckpoint
from radiance.engine.llm import LLM
from radiance.errors import ConfigError
from tests.bench.test_bench_synthetic import TINY

MODEL = "synthetic:llama-3.1-8b"


def _checkpoint(context: int) -> SyntheticCheckpoint:
    import torch

    return SyntheticCheckpoint(MODEL, device="cpu", dtype=torch.float32,
                               overrides={**TINY, "max_position_embeddings": context})


def test_a_length_above_the_context_is_refused_before_the_weights_load():
    ckpt = _checkpoint(64)
    read = []
    ckpt.iter_weights = lambda *a, **kw: read.append(1) or iter(())
    with pytest.raises(ConfigError) as err:
        LLM(MODEL, checkpoint=ckpt, device="cpu", max_model_len=65)
    message = str(err.value)
    assert "max_model_len 65 exceeds the model's context of 64 tokens" in message, message
    assert "max_position_embeddings" in message and "--max-model-len 64 or less" in message
    assert "\n" not in message and not read  # one line, and no weight was read


def test_a_length_equal_to_the_context_is_served():
    llm = LLM(MODEL, checkpoint=_checkpoint(64), device="cpu", max_model_len=64)
    assert llm.engine.max_model_len == 64
