"""A --device radiance cannot run on is one error line from every entry point (engine.devices.resolve_device),
before anything loads: `generate`, `serve`, `eval` and the `radiance.LLM` API."""

import pytest
import torch

import radiance.checkpoint
from radiance import LLM
from radiance.cli import main
from radiance.engine.devices import resolve_device
from radiance.errors import ConfigError


@pytest.fixture
def one_gpu(monkeypatch):
    """torch sees one CUDA GPU (the index check runs without one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_usable_devices_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_default_device_is_cuda_only_when_there_is_one(no_gpu):
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("device", ["foo", "gpu0", "", "cuda:-1", "meta", "mps"])
def test_unknown_devices_are_one_line(device):
    with pytest.raises(ConfigError, match="is not one radiance runs on") as err:
        resolve_device(device)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu(no_gpu, device):
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        resolve_device(device)


def test_cuda_index_past_the_gpus(one_gpu):
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match=r"'cuda:1': torch sees 1 CUDA GPU\(s\) \(cuda:0 to cuda:0\)"):
        resolve_device("cuda:1")


def test_llm_api_raises_before_loading(monkeypatch):
    monkeypatch.setattr(radiance.checkpoint, "open_checkpoint", _must_not_run)
    with pytest.raises(ConfigError, match="'foo' is not one radiance runs on"):
        LLM(device="foo")


def _must_not_run(*args, **kwargs):
    raise AssertionError("ran although the device was bad")


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"radiance {command}: error:"), err
    return err


def test_generate_bad_device_is_one_line(capsys):
    assert main(["generate", "hi", "--device", "foo"]) == 2
    assert "'foo'" in _one_error_line(capsys, "generate")


def test_generate_cuda_without_a_gpu_is_one_line(no_gpu, capsys):
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in _one_error_line(capsys, "generate")


def test_serve_bad_device_fails_before_the_port_opens(monkeypatch, capsys):
    import radiance.engine
    import radiance.server.cli

    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", _must_not_run)
    monkeypatch.setattr(radiance.server.cli, "listening_socket", _must_not_run)
    assert main(["serve", "--device", "foo"]) == 2
    assert "'foo'" in _one_error_line(capsys, "serve")


def test_eval_cuda_index_past_the_gpus_is_one_line(one_gpu, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    assert main(["eval", "ppl", "--text", str(text), "--device", "cuda:3"]) == 2
    assert "torch sees 1 CUDA GPU(s)" in _one_error_line(capsys, "eval ppl")
