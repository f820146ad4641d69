"""A model's generation_config.json sampling defaults (sampling_defaults.py): read at load, each bad value left out
with a warning naming the file and key, and none for a checkpoint without the file."""

from __future__ import annotations

import json
import logging

import pytest

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.sampling_defaults import SamplingDefaults, read_sampling_defaults
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir


def _write(tmp_path, content) -> str:
    path = tmp_path / "generation_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path)


def test_the_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    path = _write(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                             "min_p": 0, "repetition_penalty": 1.05, "max_length": 99})
    got = read_sampling_defaults(path)
    assert got == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05)
    assert isinstance(got.top_k, int)
    assert got.describe() == "temperature 0.6, top_p 0.95, top_k 20, min_p 0, repetition_penalty 1.05"
    assert read_sampling_defaults(str(tmp_path / "generation_config.json")) == got  # the file itself


def test_transformers_own_defaults_recommend_nothing_and_max_new_tokens_is_the_cap(tmp_path):
    """As vLLM reads the file (GenerationConfig.to_diff_dict): top_k 50 is transformers' default, not a choice."""
    got = read_sampling_defaults(_write(tmp_path, {"top_k": 50, "temperature": 1.0, "top_p": 0.8,
                                                   "max_new_tokens": 2048}))
    assert got == SamplingDefaults(top_p=0.8, max_tokens=2048)
    assert got.describe() == "top_p 0.8, max_tokens 2048"


def test_no_file_or_no_path_gives_none(tmp_path):
    assert read_sampling_defaults(str(tmp_path)) == SamplingDefaults()
    assert read_sampling_defaults(None).given() == {}
    assert SamplingDefaults().describe() == "none"


@pytest.mark.parametrize("content, key", [
    ({"temperature": 3.0, "top_p": 0.9}, "temperature"),
    ({"top_p": 0, "temperature": 0.7}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": "0.7"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_a_value_no_request_may_ask_for_is_left_out_with_a_warning(tmp_path, caplog, content, key):
    path = _write(tmp_path, content)
    with caplog.at_level(logging.WARNING):
        got = read_sampling_defaults(path)
    assert key not in got.given()
    assert {k: v for k, v in content.items() if k != key} == got.given()  # the good ones stay
    assert "generation_config.json" in caplog.text and key in caplog.text


@pytest.mark.parametrize("content", ["{not json", "[0.7]"])
def test_an_unreadable_file_warns_and_gives_none(tmp_path, caplog, content):
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(_write(tmp_path, content)) == SamplingDefaults()
    assert "generation_config.json" in caplog.text


def test_the_loaded_model_carries_its_checkpoints_defaults(tmp_path):
    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    _write(tmp_path, {"temperature": 0.7, "top_k": 40})
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=open_checkpoint(path), progress=False)
    assert loaded.sampling_defaults == SamplingDefaults(temperature=0.7, top_k=40)


def test_llm_generate_without_params_samples_with_the_models_defaults(tmp_path):
    from radiance import LLM

    path = write_dir(str(tmp_path), dense_state_dict(), TINY)
    _write(tmp_path, {"temperature": 0.0, "top_k": 7})
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 7, 1.0)  # top_p: SamplingParams' own
    # greedy by the file's temperature 0: two runs give the same tokens (temperature 1 would sample)
    first, second = (llm.generate([[1, 2, 3]])[0].outputs[0].token_ids for _ in range(2))
    assert first == second
