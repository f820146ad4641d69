"""`radiance generate --max-tokens N` with N beyond the model's context: one error line before generating, as the
server answers context_length_exceeded (and vLLM's OpenAI server refuses prompt + max_tokens > max_model_len).
Was: accepted silently, the output cut at the context with no word said."""

import pytest

from radiance.cli import main
from radiance.engine.llm import LLM


class _Engine:
    chat_template = None
    max_model_len = 32

    def __init__(self):
        self.requests = []

    def add_request(self, request_id, ids, params, lora_request=None):
        self.requests.append(params)

    def has_unfinished_requests(self):
        return False


class _FakeLLM:
    """What `generate` uses of an LLM: a 5-token prompt, a 32-token context, nothing generated."""

    def __init__(self):
        self.engine, self.tokenizer = _Engine(), None

    def _tokenize(self, prompt):
        return prompt, [1, 2, 3, 4, 5]


@pytest.fixture
def fake(monkeypatch):
    llm = _FakeLLM()
    monkeypatch.setattr(LLM, "from_engine_config", lambda config, **_: llm)
    return llm


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("radiance generate: error:"), err
    return err


def test_max_tokens_beyond_the_context_is_one_error_line_before_generating(fake, capsys):
    assert main(["generate", "hi", "--no-chat", "--max-tokens", "100"]) == 2
    err = _error_line(capsys)
    assert "--max-tokens 100" in err and "5 tokens" in err and "32" in err and "--max-tokens 27 or less" in err
    assert fake.engine.requests == []  # nothing generated


@pytest.mark.parametrize("max_tokens", ["27", "1"])
def test_max_tokens_that_fit_the_context_generate(fake, capsys, max_tokens):
    assert main(["generate", "hi", "--no-chat", "--max-tokens", max_tokens]) == 0
    assert [p.max_tokens for p in fake.engine.requests] == [int(max_tokens)]


def test_the_embedded_model_refuses_max_tokens_beyond_its_context(capsys):
    """The real engine's context (here lowered by --max-model-len), not only a fake's."""
    assert main(["generate", "hi", "--no-chat", "--max-model-len", "16", "--max-tokens", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading progress bar
    assert err.startswith("radiance generate: error: --max-tokens 20 does not fit the model's context of 16 tokens")
