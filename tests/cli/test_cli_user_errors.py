"""The user's mistakes past argparse: a bad value is named by the flag typed (not the config field behind it), a
convert destination that cannot take the checkpoint is refused before the source is opened, a text too short for
eval says what to change, `generate -` says it reads stdin, and `radiance serve` stopped while its model loads
exits at once."""

import io
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from radiance.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"radiance {command}: error: "), err
    return err.split(": error: ", 1)[1]


# ------------------------------------------------------------------------------ flags, not fields


FLAGS = {"quantization": "--quantization", "port": "--port", "rule": "--rule", "quantize_lm_head": "--quantize-lm-head"}


@pytest.mark.parametrize("message, given, worded", [
    ("port must be in [0, 65535]", {"port": 70000}, "--port must be in [0, 65535], got 70000"),
    # the user's value is quoted: a value that is a field's name stays as typed
    ("quantization must be one of ('auto', 'none'), got 'rule'", {"quantization": "rule"},
     "--quantization must be one of ('auto', 'none'), got 'rule'"),
    ("rule 'none' only applies to quantization 'nvfp4'", {"rule": "none"},
     "--rule 'none' only applies to --quantization 'nvfp4'"),
    # a switch's value (True) says nothing
    ("quantize_lm_head needs quantization mxfp4", {"quantize_lm_head": True},
     "--quantize-lm-head needs --quantization mxfp4"),
    ("ports and rules are words here", {}, "ports and rules are words here"),
])
def test_a_config_message_in_flag_words(message, given, worded):
    from radiance.config_cli import in_flag_words

    assert in_flag_words(message, FLAGS, given) == worded


@pytest.mark.parametrize("argv, command, error", [
    (["generate", "hi", "--block-size", "3"], "generate", "--block-size must be a power of two, got 3"),
    (["generate", "hi", "--ngram-min", "5", "--ngram-max", "2"], "generate",
     "--ngram-min must be in [1, --ngram-max], got --ngram-min 5 with --ngram-max 2"),
    (["generate", "hi", "--top-k", "-2"], "generate", "--top-k must be -1 (off) or non-negative, got -2"),
    (["serve", "--ssl-keyfile", "k.pem"], "serve",
     "HTTPS needs both --ssl-keyfile and --ssl-certfile (or neither, for HTTP), got --ssl-keyfile without "
     "--ssl-certfile"),
    (["serve", "--gpu-memory-utilization", "1.5"], "serve", "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["convert", "embedded", "/nonexistent/out", "--format", "fp3"], "convert",
     "--format must be one of ('mxfp4', 'nvfp4', 'fp8'), got 'fp3'"),
    (["convert", "embedded", "/nonexistent/out", "--max-shard-bytes", "0"], "convert",
     "--max-shard-bytes must be positive, got 0"),
])
def test_a_bad_value_is_named_by_its_flag(monkeypatch, capsys, argv, command, error):
    """Were the dataclass fields' names ("block_size must be a power of two"): not what the user typed."""
    import radiance.engine
    from radiance.engine.llm import LLM

    monkeypatch.setattr(LLM, "from_engine_config", lambda *a, **k: pytest.fail("loaded despite a bad flag"))
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", lambda *a, **k: pytest.fail("loaded despite a bad flag"))
    assert main(argv) == 2
    assert _error_line(capsys, command) == error


# ------------------------------------------------------------------------------ convert's destination


@pytest.fixture
def no_conversion(monkeypatch):
    """convert_checkpoint replaced: the destination must be refused before the source is opened."""
    from radiance.checkpoint import writer

    calls = []

    class Report:
        def summary(self):
            return "converted"

    def convert(src, dst, config, progress):
        calls.append(dst)
        return Report()

    monkeypatch.setattr(writer, "convert_checkpoint", convert)
    return calls


def test_convert_refuses_a_destination_in_use_before_opening_the_source(no_conversion, capsys, tmp_path):
    """Was refused only after the source opened: for a Hub id, after its download."""
    (tmp_path / "kept.txt").write_text("mine")
    assert main(["convert", "some/hub-model", str(tmp_path)]) == 2
    assert _error_line(capsys, "convert") == f"DST {tmp_path} exists and is not an empty directory: give a new or empty one"
    assert no_conversion == [] and os.listdir(tmp_path) == ["kept.txt"]


def test_convert_refuses_a_destination_below_a_file(no_conversion, capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    dst = tmp_path / "file" / "out" / "model"
    assert main(["convert", "embedded", str(dst)]) == 2
    assert _error_line(capsys, "convert") == (f"DST {dst}: {tmp_path / 'file'} is not a directory, so nothing can be "
                                              "written below it")
    assert no_conversion == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, which no one may write in")
def test_convert_refuses_a_destination_it_cannot_write(no_conversion, capsys):
    """Probed by writing, since os.access lets root through where the write then fails (a read-only mount)."""
    assert main(["convert", "embedded", "/proc/radiance-out/model"]) == 2
    error = _error_line(capsys, "convert")
    # /proc's errno ("No such file or directory") is left out: it told the opposite of the cause
    assert error.startswith("DST /proc/radiance-out/model: cannot create a directory in /proc: ") and "write to" in error
    assert no_conversion == []


@pytest.mark.parametrize("existing", [False, True])
def test_convert_takes_a_new_or_empty_destination_and_leaves_no_probe(no_conversion, capsys, tmp_path, existing):
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
    assert main(["convert", "embedded", str(dst)]) == 0
    assert no_conversion == [str(dst)]
    assert sorted(os.listdir(tmp_path)) == (["out"] if existing else [])
    assert not existing or os.listdir(dst) == []


# ------------------------------------------------------------------------------ eval, generate


def test_eval_on_a_text_too_short_says_what_to_change(monkeypatch, capsys, tmp_path):
    """Was "the text has 10 tokens, fewer than 1 chunk(s) of 512": nothing on what to do."""
    from radiance.bench import quality

    text = tmp_path / "short.txt"
    text.write_text("a few words")
    monkeypatch.setattr(quality, "run_eval",
                        lambda req, loader, **_: quality.chunk_token_ids(list(range(10)), req.chunks, req.chunk_len))
    assert main(["eval", "ppl", "--text", str(text)]) == 2
    assert _error_line(capsys, "eval ppl") == (
        "the text has 10 tokens, fewer than 1 chunk(s) of 512: give a longer text, or fewer tokens per chunk "
        "(--chunk-len) or chunks to skip (--first-chunk)")


class Loading(Exception):
    pass


@pytest.fixture
def no_loading(monkeypatch):
    from radiance.engine.llm import LLM

    def loading(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(LLM, "from_engine_config", loading)


def test_generate_dash_with_stdin_closed_is_one_line(no_loading, monkeypatch, capsys):
    """`radiance generate - <&-`: Python's stdin is None; was an AttributeError traceback."""
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["generate", "-"]) == 2
    assert _error_line(capsys, "generate") == ("the prompt is -, but stdin is closed: pipe the prompt in, or give it "
                                               "as the argument")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_generate_dash_at_a_terminal_says_it_reads_stdin(no_loading, monkeypatch, capsys):
    """Was silent: the command looked hung while it waited for the prompt."""
    monkeypatch.setattr(sys, "stdin", _Terminal("What is 2 + 2?\n"))
    with pytest.raises(Loading):  # the prompt was read: on to the model
        main(["generate", "-"])
    assert "reading the prompt from stdin; end it with Ctrl-D" in capsys.readouterr().err


# ------------------------------------------------------------------------------ serve stopped while loading


# `radiance serve` whose model never finishes loading (no weights read), in a process that starts with SIGINT
# ignored, as `radiance serve &` in a script does
NEVER_LOADS = """
import signal, sys, time
import radiance.engine

def never_loads(config, checkpoint=None, **_):
    time.sleep(120)

radiance.engine.AsyncLLMEngine = never_loads
signal.signal(signal.SIGINT, signal.SIG_IGN)
from radiance.cli import main
sys.exit(main(["serve", "--port", sys.argv[1]]))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_stopped_by_an_ignored_sigint_while_loading_exits_at_once(tmp_path):
    """uvicorn hands a SIGINT back to the handler it found (ignored): the server stopped, run_serve returned 0, and
    the interpreter's exit met the load thread in native code ("terminate called without an active exception",
    exit 134 with the real loader)."""
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", NEVER_LOADS, str(port)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        deadline = time.monotonic() + 60
        while True:  # up: /health answers 503 while the model loads
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 130, text
    assert text.rstrip().splitlines()[-1] == "radiance serve: interrupted while the model was loading", text
