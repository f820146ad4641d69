"""Wrong paths and broken files as a new user meets them: one error line naming what is wrong, exit 2, no traceback.
Each file here is a tiny broken one written in a temporary directory."""

import json

import pytest
import torch
from safetensors.torch import save_file

from radiance.cli import main


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"radiance {command}: error:"), err
    return err


@pytest.mark.parametrize("argv, message", [
    (["convert", "", "out"], "SRC is empty"),
    (["convert", "   ", "out"], "SRC is empty"),
    (["convert", "embedded", ""], "DST is empty"),
    (["inspect", ""], "the model path is empty"),
    (["generate", "hi", "--model", ""], "the model path is empty"),
])
def test_an_empty_path_says_so(capsys, tmp_path, monkeypatch, argv, message):
    """Was: "no such file or directory" naming no file; an empty DST was the current directory, "not empty"."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in _error_line(capsys, argv[0])
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_lone_safetensors_file_asks_for_its_directory(capsys, tmp_path):
    """Was: "not a model: expected an HF directory with config.json or a .gguf file"."""
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert main(["inspect", str(tmp_path / "model.safetensors")]) == 2
    assert "the directory holding it" in _error_line(capsys, "inspect")


def _truncated_safetensors_dir(tmp_path):
    save_file({"w": torch.zeros(1000)}, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(data[:len(data) // 2])
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return model


def _truncated_gguf(tmp_path):
    from radiance.checkpoint import embedded_model_path

    with open(embedded_model_path(), "rb") as f:
        head = f.read(100_000)  # the header runs on into its token list: cut inside it
    path = tmp_path / "cut.gguf"
    path.write_bytes(head)
    return path


@pytest.mark.parametrize("command", [["inspect"], ["convert", "{}", "{out}"]])
@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing", "no such file or directory"),
    (lambda tmp: tmp, "neither config.json nor a .gguf file"),
    (_truncated_safetensors_dir, "unreadable safetensors file (truncated or corrupt?)"),
    (_truncated_gguf, "truncated GGUF header"),
])
def test_a_broken_source_is_one_line_naming_the_file(capsys, tmp_path, command, make, message):
    src = make(tmp_path)
    argv = [a.format(src, out=tmp_path / "out") for a in command] if len(command) > 1 else [*command, str(src)]
    assert main(argv) == 2
    err = _error_line(capsys, command[0])
    assert message in err and str(src.name) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_local_directory_named_embedded_is_read_as_that_path(capsys, tmp_path, monkeypatch, command):
    """`embedded` names the embedded model only when no such local path exists (as every other command reads it);
    inspect and convert took the embedded model even then."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "embedded").mkdir()
    (tmp_path / "embedded" / "config.json").write_text("{not json")
    argv = ["inspect", "embedded"] if command == "inspect" else ["convert", "embedded", "out"]
    assert main(argv) == 2
    assert "config.json is not valid JSON" in _error_line(capsys, command)
