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


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_yarn_extends_the_context_to_the_original_length_times_the_factor():
    """Qwen3's long-context recipe adds YaRN (factor 4 over 32k) and leaves max_position_embeddings at 40960;
    vLLM serves original x factor (131072). Here 32 x 4 = 128 over a max_position_embeddings of 48: the engine
    takes max_model_len 128, serves positions past 48 (the rotary table reaches 128), and refuses 129 naming
    YaRN as the source."""
    import torch

    from radiance.engine.sampling_params import SamplingParams

    def checkpoint():
        return SyntheticCheckpoint("synthetic:qwen3-8b", device="cpu", dtype=torch.float32,
                                   overrides={**TINY, "max_position_embeddings": 48, "rope_scaling": YARN})

    llm = LLM("synthetic:qwen3-8b", checkpoint=checkpoint(), device="cpu", max_model_len=128)
    assert llm.engine.max_model_len == 128
    out = llm.generate(list(range(1, 91)),
                       SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 30  # positions 90..119, past max_position_embeddings
    with pytest.raises(ConfigError, match="exceeds the model's context of 128 tokens .*YaRN"):
        LLM("synthetic:qwen3-8b", checkpoint=checkpoint(), device="cpu", max_model_len=129)


@pytest.mark.parametrize("scaling, context", [
    (None, 48),
    (YARN, 128),
    ({"type": "yarn", "factor": 2, "original_max_position_embeddings": 16}, 32),  # below max_position_embeddings
    ({"rope_type": "linear", "factor": 4.0}, 48),  # linear configs give the scaled length already
    ({"rope_type": "dynamic", "factor": 4.0}, 48),  # served as the default rope: only up to 48
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8}, 48),
])
def test_context_length_follows_the_rope_scaling(scaling, context):
    from radiance.models.registry import resolve_architecture

    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 100, "max_position_embeddings": 48, "rope_scaling": scaling}
    arch = resolve_architecture(config)[1]
    assert arch.context_length == context
    assert arch.max_position_embeddings == 48


def test_inspect_names_the_yarn_context(tmp_path):
    from radiance.checkpoint import open_checkpoint
    from radiance.checkpoint.inspect import inspect_lines
    from tests.checkpoint.factory import TINY as TINY_LLAMA, dense_state_dict, write_dir

    yarn = {**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    config_line = next(line for line in inspect_lines(open_checkpoint(write_dir(str(tmp_path / "y"),
                                                                                dense_state_dict(yarn), yarn)))
                       if line.startswith("config"))
    assert config_line.endswith("max len 256, YaRN context 512"), config_line
    plain = next(line for line in inspect_lines(open_checkpoint(write_dir(str(tmp_path / "p"), dense_state_dict(),
                                                                          TINY_LLAMA)))
                 if line.startswith("config"))
    assert plain.endswith("max len 256"), plain
