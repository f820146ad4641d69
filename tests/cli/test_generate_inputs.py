"""`radiance generate` / `serve` inputs a new user gets wrong: bytes that are not UTF-8 (a traceback from the tokenizer, or
a decoder message naming no file), `--chat` on a model without a template (silently raw), and a constrained output cut
by --max-tokens (printed as if valid)."""

import functools

import pytest

from radiance.cli import main
from radiance.engine.llm import LLM


@functools.cache
def _text_tokenizer():
    """A real tokenizer for the fakes' token ids: generate feeds a cut constrained output's to the constraint's
    matcher."""
    from tests.engine.conftest import tiny_byte_bpe_tokenizer

    return tiny_byte_bpe_tokenizer()


@functools.cache
def _grammar_backend():
    from radiance.engine.structured_output import GrammarBackend
    from tests.engine.conftest import TINY_TOKENIZER_VOCAB

    tokenizer = _text_tokenizer()
    return GrammarBackend(tokenizer, TINY_TOKENIZER_VOCAB, [tokenizer.eos_token_id])


class _Output:
    def __init__(self, text, finish_reason):
        self.text, self.finish_reason = text, finish_reason

    @property
    def token_ids(self):
        return _text_tokenizer()(self.text, add_special_tokens=False).input_ids


class _Engine:
    chat_template = None
    max_model_len = 128

    def __init__(self):
        self.steps = [[_Output('{"a": 1', "length")]]

    def grammar_backend(self):
        return _grammar_backend()

    def add_request(self, request_id, ids, params, lora_request=None):
        self.params = params

    def has_unfinished_requests(self):
        return bool(self.steps)

    def step(self):
        return self.steps.pop(0)


class _FakeLLM:
    """What `generate` uses of an LLM: no chat template, a 3-token prompt, one step that ends at max_tokens."""

    def __init__(self):
        self.engine, self.tokenizer = _Engine(), None

    def _tokenize(self, prompt):
        return prompt, [1, 2, 3]


@pytest.fixture
def fake(monkeypatch):
    llm, loads = _FakeLLM(), []
    monkeypatch.setattr(LLM, "from_engine_config", lambda config, **_: loads.append(config) or llm)
    llm.loads = loads
    return llm


def _error_line(capsys, prefix="radiance generate: error:") -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(prefix), err
    return err


@pytest.mark.parametrize("argv, what", [
    (["hi \udcff there", "--no-chat"], "the prompt"),  # how Python hands on a byte that is not UTF-8
    (["hi", "--system", "a\udcffb"], "--system"),
])
def test_text_that_is_not_utf8_is_one_error_line_before_the_model_loads(fake, capsys, argv, what):
    """Was: a TypeError traceback from the tokenizer, exit 1."""
    assert main(["generate", *argv]) == 2
    assert f"{what} is not valid UTF-8 text" in _error_line(capsys)
    assert fake.loads == []


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_a_constraint_file_that_is_not_utf8_names_the_flag_and_file(fake, capsys, tmp_path, flag):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xd7\xff\x00binary")
    assert main(["generate", "hi", flag, str(path)]) == 2
    assert f"{flag}: {path} is not UTF-8 text" in _error_line(capsys)  # was the codec's message alone


@pytest.mark.parametrize("flag, value, message", [
    ("--regex", "a(b", "invalid regex constraint: Regex parsing error at position 4"),
    ("--grammar", "root ::= foo", 'invalid grammar constraint: EBNF parser error at line 1, column 10: Rule "foo"'),
    ("--json-schema", '{"type": "objectx"}', 'invalid json constraint: Unsupported type "objectx"'),
    ("--choice", None, "invalid choice constraint: 1001 choices, more than the 1000 allowed"),
])
def test_a_constraint_that_does_not_parse_is_one_line_before_the_model_loads(fake, capsys, tmp_path, flag, value,
                                                                              message):
    """Was: found when the request was added, after the model had loaded (xgrammar parses without a tokenizer)."""
    if flag == "--grammar":
        (tmp_path / "g.ebnf").write_text(value)
        value = str(tmp_path / "g.ebnf")
    values = [f"c{i}" for i in range(1001)] if flag == "--choice" else [value]
    assert main(["generate", "hi", flag, *values]) == 2
    assert message in _error_line(capsys)
    assert fake.loads == []


def test_a_constraint_that_parses_reaches_the_engine(fake, capsys):
    fake.engine.steps = [[_Output("ab", "stop")]]  # a finished output (one cut by --max-tokens exits 1)
    assert main(["generate", "hi", "--regex", "[ab]+", "--no-chat"]) == 0
    assert fake.engine.params.structured_output.regex == "[ab]+"


def test_an_answer_stdout_cannot_encode_is_printed_escaped(fake, monkeypatch):
    """stdout in ASCII (PYTHONIOENCODING=ascii; a Windows pipe's cp1252 is the same story): the answer's characters
    come out as \\u escapes, exit 0 (was an encoding error after generating, exit 2, the answer lost)."""
    import io
    import sys

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    fake.engine.steps = [[_Output("\u732b ok", "stop")]]
    assert main(["generate", "cat?", "--no-chat"]) == 0
    sys.stdout.flush()
    assert raw.getvalue().decode("ascii").startswith("\\u732b ok")


def test_serve_a_chat_template_that_is_not_utf8_names_the_flag_and_file(capsys, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_bytes(b"\xd7\xff{{ messages }}")
    assert main(["serve", "--chat-template", str(path)]) == 2
    assert f"--chat-template {path}: the file is not UTF-8 text" in _error_line(capsys, "radiance serve: error:")


def test_chat_on_a_model_without_a_template_is_an_error_and_the_default_goes_raw(fake, capsys):
    """--chat was ignored without a word (the prompt went in raw); unset, a template-less model takes raw text."""
    assert main(["generate", "hi", "--chat"]) == 2
    assert "--chat: the model has no chat template" in _error_line(capsys)
    fake.engine.steps = [[_Output("raw", "stop")]]
    assert main(["generate", "hi"]) == 0
    assert capsys.readouterr().out == "raw\n"


def test_a_constrained_output_cut_by_max_tokens_says_it_is_not_valid(fake, capsys, caplog):
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):
        assert main(["generate", "hi", "--no-chat", "--json", "--max-tokens", "4"]) == 1  # not valid: exit 1
    assert capsys.readouterr().out == '{"a": 1\n'
    assert any("--max-tokens 4 cut the output before the constraint was complete" in r.getMessage()
               for r in caplog.records)
    fake.engine.steps = [[_Output("plain", "length")]]  # no constraint: a cut is the usual max_tokens end
    caplog.clear()
    assert main(["generate", "hi", "--no-chat", "--max-tokens", "4"]) == 0
    assert not [r for r in caplog.records if "constraint" in r.getMessage()]


def test_stop_min_p_and_ignore_eos_reach_the_engine(fake, capsys):
    """The engine's and the server's stop strings, min_p and ignore_eos had no generate flags."""
    assert main(["generate", "hi", "--no-chat", "--stop", "Blue", "--stop", "\n\n", "--min-p", "0.1",
                 "--ignore-eos"]) == 0
    params = fake.engine.params
    assert params.stop == ("Blue", "\n\n") and params.min_p == 0.1 and params.ignore_eos
    fake.engine.steps = [[_Output("x", "stop")]]
    assert main(["generate", "hi", "--no-chat"]) == 0
    assert fake.engine.params.stop == () and fake.engine.params.min_p == 0.0 and not fake.engine.params.ignore_eos


def test_the_choice_flag_says_how_to_give_the_prompt(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "end the list with --" in " ".join(capsys.readouterr().out.split())
