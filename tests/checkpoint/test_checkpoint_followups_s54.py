"""Session 54 audit follow-ups: `inspect --values` lists every refused scale (it stopped at the first), a chat
template that does not parse is an inspect warning and its parse error names the file holding it, and a tensor
"missing" from a sharded checkpoint names the shard its index leaves out. Fifty-fifth session: a GGUF's broken template
is named by generate too, generate refuses one before the weights load, and serve says so at startup."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.values import value_warnings
from radiance.cli import main
from radiance.errors import CheckpointError, ConfigError
from tests.checkpoint.factory import (CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict, linear_modules,
                                      write_dir, write_sharded)
from tests.checkpoint.test_broken_values import _one_error_line
from tests.checkpoint.test_gguf_chat_templates import named_templates, spm_tokenizer
from tests.checkpoint.test_gguf_metadata import write_gguf

BROKEN = "{% for m in messages %}{{ m.content "  # an unclosed print statement: jinja's syntax error on line 1


# ------------------------------------------------------------------ inspect --values reads past a refused scale

def _nan_scales(tensors: dict, module: str) -> None:
    scale = f"{module}.weight_scale"
    tensors[scale] = tensors[scale].view(torch.uint8).clone().fill_(0xFF).view(torch.float8_e4m3fn)


def test_values_lists_each_refused_scale_and_reads_on(tmp_path, capsys):
    """Was: the first refused scale ended the pass ("reading stopped: ..."): the second and a NaN norm after it
    went unreported."""
    tensors = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    _nan_scales(tensors, "model.layers.0.mlp.down_proj")
    _nan_scales(tensors, "model.layers.1.self_attn.o_proj")
    tensors["model.norm.weight"][5] = float("nan")
    path = write_dir(str(tmp_path / "m"), tensors, TINY, CT_NVFP4_CONFIG, tokenizer=True)
    read, warnings = value_warnings(open_checkpoint(path), progress=False)
    assert read == 15 and len(warnings) == 3, warnings
    assert "model.layers.0.mlp.down_proj.weight_scale" in warnings[0]
    assert "model.layers.1.self_attn.o_proj.weight_scale" in warnings[1]
    assert "tensor model.norm.weight)" in warnings[2]
    assert not any(w.startswith("reading stopped") for w in warnings)
    assert main(["inspect", path, "--values", "--strict", "--no-progress"]) == 1
    assert "values     15 weights read: 3 faulty (warnings)" in capsys.readouterr().out


# ------------------------------------------------------------------ chat templates that do not parse

def _with_template(tmp_path, where: str) -> tuple[str, str]:
    """A tiny model whose chat template does not parse, held in `where`; (model dir, that file)."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, tokenizer=True)
    file = os.path.join(path, where)
    if where == "chat_template.jinja":
        with open(file, "w") as handle:
            handle.write(BROKEN)
    else:
        with open(file) as handle:
            config = json.load(handle)
        with open(file, "w") as handle:
            json.dump(dict(config, chat_template=BROKEN), handle)
    return path, file


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_inspect_strict_fails_on_a_template_that_does_not_parse(tmp_path, capsys, where):
    """Was: rc 0, "chat template yes", warnings none; generate then failed."""
    path, file = _with_template(tmp_path, where)
    assert main(["inspect", path, "--tokenizer", "--strict"]) == 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  - ")]
    assert len(warnings) == 1 and "chat template does not parse" in warnings[0] and f"line 1, file {file})" \
        in warnings[0], warnings


def test_the_parse_error_of_generate_names_the_file(tmp_path, capsys):
    """Was: "chat template does not parse: ... (line 1)", the file unnamed (the jinja file, tokenizer_config.json's
    or --chat-template's?)."""
    path, file = _with_template(tmp_path, "chat_template.jinja")
    assert main(["generate", "w3 w4", "--model", path, "--device", "cpu", "--no-progress", "--max-tokens", "2"]) == 2
    err = _one_error_line(capsys, "generate")
    assert "chat template does not parse" in err and file in err


def test_a_gguf_template_that_does_not_parse_names_the_file_and_key(tmp_path, capsys):
    path = str(write_gguf(tmp_path / "m.gguf", metadata={**spm_tokenizer(), **named_templates(
        default="{% for m in messages %}{{ m['content'] }}{% endfor %}", tool_use=BROKEN)}))
    assert main(["inspect", path, "--strict"]) == 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  - ")]
    assert len(warnings) == 1, warnings
    assert f"file {path}, metadata tokenizer.chat_template.tool_use)" in warnings[0] and "'tool_use'" in warnings[0]


# ------------------------------------------------------------------ an index that leaves a shard out

def test_a_shard_the_index_leaves_out_is_named(tmp_path):
    """Was: "tensor missing from the checkpoint (file DIR, tensor ...)", though the tensor is in that shard."""
    path = write_sharded(str(tmp_path / "m"), dense_state_dict(), TINY)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as handle:
        data = json.load(handle)
    data["weight_map"] = {k: f for k, f in data["weight_map"].items() if f == "model-00001-of-00002.safetensors"}
    with open(index, "w") as handle:
        json.dump(data, handle)
    with pytest.raises(CheckpointError, match="tensor missing") as info:
        open_checkpoint(path)
    assert ("the index model.safetensors.index.json does not list model-00002-of-00002.safetensors, which is in "
            "the directory") in str(info.value)


@pytest.mark.parametrize("unrelated_file", [False, True])
def test_a_tensor_missing_from_a_complete_index_has_no_such_note(tmp_path, unrelated_file):
    """Nor when the directory holds another safetensors file the index does not list but which lacks the tensor too
    (Mistral's repos ship consolidated.safetensors beside the indexed shards)."""
    tensors = dense_state_dict()
    del tensors["model.norm.weight"]
    path = write_sharded(str(tmp_path / "m"), tensors, TINY)
    if unrelated_file:
        save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, os.path.join(path, "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match="tensor missing") as info:
        open_checkpoint(path)
    assert "does not list" not in str(info.value)


def test_generate_names_the_gguf_file_and_key_of_a_template_that_does_not_parse(tmp_path, capsys):
    """Was: "chat template does not parse: ... (line 1)": only inspect named a GGUF's metadata key (fifty-fifth
    session)."""
    path = str(write_gguf(tmp_path / "m.gguf", metadata={**spm_tokenizer(), **named_templates(default=BROKEN)}))
    assert main(["generate", "w3 w4", "--model", path, "--device", "cpu", "--no-progress", "--max-tokens", "2"]) == 2
    err = _one_error_line(capsys, "generate")
    assert "chat template does not parse" in err and f"file {path}, metadata tokenizer.chat_template)" in err, err


@pytest.mark.parametrize("form", ["directory", "gguf"])
def test_generate_refuses_a_template_that_does_not_parse_before_loading_weights(tmp_path, capsys, monkeypatch, form):
    """Was: found at the first render, after the weights loaded (minutes on a large model); --no-chat still runs."""
    from radiance.engine import llm_engine

    if form == "gguf":
        path = str(write_gguf(tmp_path / "m.gguf", metadata={**spm_tokenizer(), **named_templates(default=BROKEN)}))
    else:
        path, _ = _with_template(tmp_path, "chat_template.jinja")
    loads = []
    real_load = llm_engine.load_model
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    assert main(["generate", "w3 w4", "--model", path, "--device", "cpu", "--no-progress", "--max-tokens", "2"]) == 2
    assert "chat template does not parse" in _one_error_line(capsys, "generate") and loads == []
    assert main(["generate", "w3 w4", "--model", path, "--device", "cpu", "--no-progress", "--max-tokens", "2",
                 "--no-chat"]) == 0
    assert loads == [1]


def test_serve_says_at_startup_that_the_model_template_does_not_parse(tmp_path, caplog, monkeypatch):
    """Before the model loads, naming the file (chat requests fail with the same words; completions still serve);
    a --chat-template given replaces the model's, so then nothing is said."""
    from radiance.server import cli as serve_cli

    path, file = _with_template(tmp_path, "chat_template.jinja")

    def stop(*args, **kwargs):  # the port would be bound next: the startup checks are done
        raise ConfigError("stopped before binding")

    monkeypatch.setattr(serve_cli, "listening_socket", stop)
    with caplog.at_level(logging.WARNING, logger="radiance.server.cli"):
        assert main(["serve", path, "--device", "cpu"]) == 2
    assert "chat template does not parse" in caplog.text and f"file {file})" in caplog.text
    assert "chat requests using it will fail" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radiance.server.cli"):
        assert main(["serve", path, "--device", "cpu", "--chat-template", "{{ messages[0]['content'] }}"]) == 2
    assert "does not parse" not in caplog.text
