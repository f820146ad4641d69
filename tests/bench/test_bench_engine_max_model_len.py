"""`radiance bench engine` asks the engine for what fits the model's context: the engine refuses a max_model_len above
it, and the bench asked for its deepest measurement + 256 whatever the context."""

import pytest

from radiance.bench import engine_bench
from radiance.errors import ConfigError
from tests.bench.test_bench_synthetic import TINY

MODEL = "synthetic:llama-3.1-8b"
SMALL = {**TINY, "vocab_size": 512, "max_position_embeddings": 160}  # a context below 80 + 256


@pytest.fixture
def asked(monkeypatch):
    """The max_model_len each variant's engine is built with."""
    lengths, build = [], engine_bench._engine

    def spy(model, quantization, max_model_len, *args, **kwargs):
        lengths.append(max_model_len)
        return build(model, quantization, max_model_len, *args, **kwargs)

    monkeypatch.setattr(engine_bench, "_engine", spy)
    return lengths


def test_the_length_asked_is_capped_at_the_context(asked):
    rows = engine_bench.run(MODEL, variants=("none",), contexts=(16, 80), prefills=(24,), concurrencies=(1,),
                            with_hf=False, device="cpu", overrides=SMALL)
    assert "error" not in rows[0], rows[0].get("error")
    assert asked == [160] and rows[0]["decode_ms@80"] > 0


def test_the_length_asked_below_the_context_keeps_its_headroom(asked):
    engine_bench.run(MODEL, variants=("none",), contexts=(16,), prefills=(24,), concurrencies=(1,),
                     with_hf=False, device="cpu", overrides={**SMALL, "max_position_embeddings": 512})
    assert asked == [24 + engine_bench.HEADROOM]


@pytest.mark.parametrize("contexts, prefills, message", [
    ((16, 126), (24,), f"--contexts 126 does not fit {MODEL}'s context of 160 tokens"),
    ((16,), (24, 160), f"--prefills 160 does not fit {MODEL}'s context of 160 tokens"),
])
def test_a_depth_that_does_not_fit_is_refused_before_any_model_is_built(asked, contexts, prefills, message):
    with pytest.raises(ConfigError, match=message) as err:
        engine_bench.run(MODEL, variants=("none",), contexts=contexts, prefills=prefills, concurrencies=(1,),
                         with_hf=False, device="cpu", overrides=SMALL)
    assert "or less" in str(err.value) and asked == []


def test_the_deepest_depths_that_fit_are_measured(asked):
    rows = engine_bench.run(MODEL, variants=("none",), contexts=(125,), prefills=(159,), concurrencies=(1,),
                            with_hf=False, device="cpu", overrides=SMALL)
    assert "error" not in rows[0], rows[0].get("error")
    assert asked == [160] and rows[0]["decode_ms@125"] > 0 and rows[0]["prefill_tok_s@159"] > 0
