"""`radiance convert` follow-ups of the fifty-fourth session (a first-time user's audit):
1. a full disk while writing a shard is the usual one-line error and leaves nothing behind (safetensors' own
   SafetensorError passed every handler as a traceback);
2. a conversion that fails mid-stream closes its reading progress bar before the error is printed (the error line was
   glued to the bar's line);
3. vLLM's LLM arguments at their default-equivalent values (load_format="auto", task="generate") are accepted."""

from __future__ import annotations

import pytest
from safetensors import SafetensorError

from radiance.checkpoint import safetensors_io
from radiance.cli import main
from radiance.errors import ConfigError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.checkpoint.test_broken import _with_nan


def test_a_full_disk_while_converting_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)

    def no_space(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors_io, "save_file", no_space)
    assert main(["convert", path, str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "radiance convert: error: cannot write while converting: cannot write a shard" in err
    assert "No space left on device" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_failed_conversion_prints_its_error_on_a_line_of_its_own(tmp_path, capsys):
    sd = dense_state_dict()
    _with_nan(sd, "model.layers.1.mlp.down_proj.weight")
    path = write_dir(str(tmp_path / "src"), sd, TINY)
    assert main(["convert", path, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "reading" in err  # the bar was drawn
    lines = [line for line in err.replace("\r", "\n").split("\n") if "radiance convert: error" in line]
    assert lines and lines[-1].startswith("radiance convert: error"), err[-400:]


@pytest.mark.parametrize("option", [{"load_format": "auto"}, {"load_format": "safetensors"}, {"task": "generate"},
                                    {"task": "auto"}])
def test_vllm_arguments_at_their_defaults_are_accepted(option):
    from radiance.engine.llm import _vllm_model_args

    config = dict(option)
    assert _vllm_model_args("m", config) == "m" and config == {}  # taken out, nothing left for the engine


@pytest.mark.parametrize("option", [{"load_format": "dummy"}, {"task": "embed"}])
def test_vllm_arguments_radiance_cannot_honour_are_refused(option):
    from radiance.engine.llm import _vllm_model_args

    name, value = next(iter(option.items()))
    with pytest.raises(ConfigError, match=f"{name} must be .*; got {value!r}"):
        _vllm_model_args("m", dict(option))
