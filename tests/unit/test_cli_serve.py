"""`radiance serve`: bad flags are one error line before the model loads (and before the port opens where the
port is not the problem); the socket is bound before loading, so --port 0 serves on a free port it reports."""

import argparse
import json
import logging
import socket
import urllib.error
import urllib.request

import pytest

import radiance.engine
import radiance.server.cli
from radiance.cli import main
from radiance.config import ServerConfig
from radiance.errors import ConfigError
from radiance.server.cli import configs_from_args, listening_socket, register


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model loaded although a flag was bad")


@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", _must_not_load)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("radiance serve: error:"), err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--host", ""], "--host must be non-empty"),
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level must be one of"),
    (["--tool-call-parser", "harmony", "--reasoning-parser", "none"], "needs the harmony reasoning parser"),
    (["--tool-call-parser", "harmony", "--reasoning-parser", "think"], "needs the harmony reasoning parser"),
    (["--chat-template", "{% for %}"], "chat template does not parse"),
    (["--chat-template", "/nonexistent/t.jinja"], "chat template file not found"),
    (["--host", "not a host!"], "cannot listen on not a host! port 0"),
    (["--max-model-len", "0"], "--max-model-len must be positive"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be positive"),
    (["--api-key", ""], "--api-key must be non-empty"),
    (["--tool-call-parser", "xml"], "--tool-call-parser must be one of"),
    (["--reasoning-parser", "r1"], "--reasoning-parser must be one of"),
    # were accepted: the model loaded, then no request could ever authenticate / /v1/models listed a name twice
    (["--api-key", " "], "--api-key must be printable ASCII without leading or trailing spaces"),
    (["--api-key", "key "], "--api-key must be printable ASCII without leading or trailing spaces"),
    (["--api-key", "cl\u00e9"], "--api-key must be printable ASCII"),
    (["--served-model-name", "a", "b", "a"], "--served-model-name lists 'a' more than once"),
    (["--seed", str(2**63)], "--seed must be a 64-bit signed integer"),
])
def test_bad_server_flags_fail_before_loading(no_loading, capsys, argv, message):
    assert main(["serve", *argv, "--port", "0"]) == 2
    assert message in _one_error_line(capsys)


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_a_port_out_of_range_is_one_line_before_loading(no_loading, capsys, port):
    assert main(["serve", "--port", port]) == 2
    assert f"--port must be in [0, 65535], got {port}" in _one_error_line(capsys)


def test_good_api_keys_and_names_pass():
    config = ServerConfig(api_key="sk-a b~!", served_model_name=("a", "b"))
    assert config.api_key == "sk-a b~!" and config.served_model_name == ("a", "b")


def test_a_chat_template_that_is_a_directory_is_one_line(no_loading, tmp_path, capsys):
    assert main(["serve", "--chat-template", str(tmp_path), "--port", "0"]) == 2
    assert "cannot read it" in _one_error_line(capsys)


def test_the_checks_before_loading_keep_good_values(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    _, server = configs_from_args(parse(["--chat-template", str(template), "--uvicorn-log-level", "INFO",
                                         "--tool-call-parser", "harmony", "--device", "cpu"]))
    assert server.chat_template == str(template) and server.tool_call_parser == "harmony"


def test_server_config_rejects_an_empty_host_and_unknown_uvicorn_levels():
    with pytest.raises(ValueError, match="host"):
        ServerConfig(host=" ")
    with pytest.raises(ValueError, match="uvicorn_log_level"):
        ServerConfig(uvicorn_log_level="verbose")
    assert ServerConfig(uvicorn_log_level="trace", port=0).port == 0


def test_a_taken_port_is_one_line_before_loading(no_loading, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in _one_error_line(capsys)


def test_a_host_of_no_local_interface_is_one_line_before_loading(no_loading, capsys):
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no interface's address: the bind fails without a DNS lookup
    assert main(["serve", "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "cannot listen on 192.0.2.1 port 0" in _one_error_line(capsys)


def test_listening_socket_takes_a_free_port_for_port_0():
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_port_0_serves_on_the_port_it_reports(monkeypatch, caplog, capsys):
    """The pre-bound socket is the one uvicorn serves on: /health answers on the reported port while the model
    "loads" (this fake load then fails, which stops the server with one error line)."""
    bound = []

    def recording_socket(host, port):
        sock = listening_socket(host, port)
        bound.append(sock.getsockname()[1])
        return sock

    health = {}

    def fake_engine(config, checkpoint=None, **_):
        url = f"http://127.0.0.1:{bound[0]}/health"
        try:
            urllib.request.urlopen(url, timeout=10)
        except urllib.error.HTTPError as exc:  # 503 while loading
            health.update(status=exc.code, body=json.loads(exc.read()))
        raise ConfigError("fake load failure")

    monkeypatch.setattr(radiance.server.cli, "listening_socket", recording_socket)
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", fake_engine)
    with caplog.at_level(logging.INFO, logger="radiance.server.cli"):
        assert main(["serve", "--port", "0"]) == 2
    port = bound[0]
    assert health["status"] == 503 and "loading" in health["body"]["error"]["message"]
    assert f"the API at http://127.0.0.1:{port} answers /health" in caplog.text
    assert "fake load failure" in _one_error_line(capsys)


def test_the_bound_socket_takes_connections_before_uvicorn_starts():
    """The model loads in a thread from the lifespan's startup, before uvicorn listens: a client (or the load
    itself) that came then was refused (a clean-clone CI run saw test_port_0_serves_on_the_port_it_reports fail
    so once)."""
    server = listening_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(server.getsockname(), timeout=2) as client:
            server.settimeout(2)
            accepted, _ = server.accept()  # queued in the backlog until then (uvicorn accepts it later)
            with accepted:
                client.sendall(b"ping")
                assert accepted.recv(4) == b"ping"
    finally:
        server.close()


def test_uvicorns_graceful_timeout_error_becomes_an_info_line():
    """The streams still running 5 s after a shutdown signal are ended by design; uvicorn's ERROR line for it read as
    a failure. Its exact format string (uvicorn.server) is what the filter rewrites; other errors pass unchanged."""
    import inspect
    import logging

    import uvicorn.server

    from radiance.server.cli import graceful_timeout_as_info

    class Keep(logging.Handler):  # on the logger itself: uvicorn's config may have stopped its propagation
        records: list = []

        def emit(self, record):
            self.records.append(record)

    fmt = "Cancel %s running task(s), timeout graceful shutdown exceeded"
    assert fmt in inspect.getsource(uvicorn.server)
    uvicorn_error, keep = logging.getLogger("uvicorn.error"), Keep()
    uvicorn_error.addHandler(keep)
    try:
        with graceful_timeout_as_info():
            uvicorn_error.error(fmt, 3)
            uvicorn_error.error("something else")
    finally:
        uvicorn_error.removeHandler(keep)
    (note, other) = keep.records[-2:]
    assert note.levelname == "INFO" and note.getMessage().startswith("shutdown: 3 request(s) still running")
    assert other.levelname == "ERROR" and other.getMessage() == "something else"
