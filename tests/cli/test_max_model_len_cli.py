"""`--max-model-len` above the model's context: one error line naming the context and the flag, exit 2, before
the weights load (it was lowered to the context with a warning, and the command went on)."""

import pytest

import radiance.engine
from radiance.cli import main
from radiance.errors import ConfigError

EMBEDDED_CONTEXT = 8192  # the embedded SmolLM2 GGUF's context_length


def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    assert len(err.splitlines()) == 1 and err.startswith(f"radiance {command}: error:"), err
    return err


def _names_the_context(err: str) -> None:
    assert f"max_model_len {EMBEDDED_CONTEXT + 1} exceeds the model's context of {EMBEDDED_CONTEXT} tokens" in err
    assert "context_length" in err and f"--max-model-len {EMBEDDED_CONTEXT} or less" in err


def test_generate_refuses_a_length_above_the_context(capsys):
    assert main(["generate", "hi", "--no-chat", "--max-tokens", "1",
                 "--max-model-len", str(EMBEDDED_CONTEXT + 1)]) == 2
    _names_the_context(_one_error_line(capsys, "generate"))


def test_serve_refuses_a_length_above_the_context(monkeypatch, capsys):
    real = radiance.engine.AsyncLLMEngine

    def engine_then_stop(config, checkpoint=None, **_):  # a load that succeeds stops the server too (the old code served on)
        real(config, checkpoint=checkpoint)
        raise ConfigError("the engine loaded")

    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", engine_then_stop)
    assert main(["serve", "--port", "0", "--max-model-len", str(EMBEDDED_CONTEXT + 1)]) == 2
    _names_the_context(_one_error_line(capsys, "serve"))


def test_help_says_a_length_above_the_context_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a value above the context is refused (no rotary angles past it, so there is no override)" in out
