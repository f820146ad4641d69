"""`radiance generate` as a new user meets it: a prompt from stdin, and mistakes found before the model loads."""

import io

import pytest

from radiance.cli import main
from radiance.engine.llm import LLM


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("radiance generate: error:"), err
    return err


@pytest.fixture
def no_loading(monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded although an option was bad")

    monkeypatch.setattr(LLM, "from_engine_config", must_not_load)


class _FakeLLM:
    """What `generate` uses of an LLM, without a model: records the prompt it is given, generates nothing."""

    class _Engine:
        chat_template = None
        max_model_len = 8192  # generate checks --max-tokens against it

        def add_request(self, request_id, ids, params, lora_request=None):
            pass

        def has_unfinished_requests(self):
            return False

    def __init__(self):
        self.engine, self.tokenizer, self.prompts = self._Engine(), None, []

    def _tokenize(self, prompt):
        self.prompts.append(prompt)
        return prompt, [1]


def test_a_dash_reads_the_prompt_from_stdin(monkeypatch):
    """`generate -` sent the prompt "-" to the model; a long prompt had to be quoted on the command line."""
    fake = _FakeLLM()
    monkeypatch.setattr(LLM, "from_engine_config", lambda config, **_: fake)
    monkeypatch.setattr("sys.stdin", io.StringIO("Summarize:\nline one\nline two\n"))
    assert main(["generate", "-", "--no-chat", "--max-tokens", "1"]) == 0
    assert fake.prompts == ["Summarize:\nline one\nline two"]


def test_an_empty_stdin_is_one_line_before_loading(no_loading, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["generate", "-"]) == 2
    assert "stdin holds no text" in _one_error_line(capsys)


@pytest.mark.parametrize("schema", ["{bad", '{"type": "object",}'])
def test_a_json_schema_that_does_not_parse_fails_before_loading(no_loading, capsys, schema):
    """Broken schema JSON was found only when the request was added, after the model loaded (30 s on a CPU here)."""
    assert main(["generate", "hi", "--json-schema", schema]) == 2
    assert "--json-schema is not valid JSON" in _one_error_line(capsys)


def test_a_json_schema_file_that_does_not_parse_fails_before_loading(no_loading, capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object", "properties": ')
    assert main(["generate", "hi", "--json-schema", str(path)]) == 2
    assert "--json-schema is not valid JSON" in _one_error_line(capsys)


def test_system_without_chat_is_refused_before_loading(no_loading, capsys):
    """--system is a chat message: with --no-chat it was dropped without a word."""
    assert main(["generate", "hi", "--no-chat", "--system", "be brief"]) == 2
    assert "--system" in _one_error_line(capsys)


class _ClosedPipe:
    """stdout after its reader went away (`radiance ... | head -1`): writes, or the flush of what was written, raise."""

    def __init__(self, fail_on_write: bool):
        self.fail_on_write = fail_on_write

    def write(self, text):
        if self.fail_on_write:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_mid_stream_is_no_traceback(monkeypatch):
    """`radiance generate ... | head -c 3` ended in a BrokenPipeError traceback."""
    monkeypatch.setattr(LLM, "from_engine_config", lambda config, **_: _FakeLLM())
    monkeypatch.setattr("sys.stdout", _ClosedPipe(fail_on_write=True))
    assert main(["generate", "hi", "--no-chat"]) == 141


def test_output_still_buffered_when_the_reader_went_away_is_no_traceback(monkeypatch, tmp_path):
    """A command that prints its result at the end (`eval --json | head -1`) met the closed pipe only at Python's flush
    at exit, outside any handler."""
    from radiance.bench import quality

    text = tmp_path / "t.txt"
    text.write_text("some text")
    monkeypatch.setattr(quality, "run_eval", lambda req, loader, **_: {"ppl": 12.5})
    monkeypatch.setattr("sys.stdout", _ClosedPipe(fail_on_write=False))
    assert main(["eval", "ppl", "--text", str(text), "--json"]) == 141
