"""HTTPS (--ssl-keyfile / --ssl-certfile, checked before the model loads) and browser access (CORS: local pages by
default, --allowed-origins for others, preflights answered before the API-key check)."""

import logging
import ssl
from pathlib import Path

import httpx
import pytest

import radiance.engine
import radiance.server.cli
from radiance.cli import main
from radiance.errors import ConfigError
from radiance.server.cli import listening_socket
from tests.server.fake_engine import FakeEngine, serve_engine

DATA = Path(__file__).parent / "data"
CERT, KEY = str(DATA / "localhost.crt"), str(DATA / "localhost.key")  # self-signed for localhost, a test's only


def test_https_serves_with_the_given_key_and_certificate(monkeypatch, caplog, capsys):
    """The real `serve` path with a fake load: while it "loads", /health answers 503 over TLS (verified against
    the certificate) and plain HTTP gets no answer; the startup line names an https:// URL."""
    bound, seen = [], {}

    def recording_socket(host, port):
        sock = listening_socket(host, port)
        bound.append(sock.getsockname()[1])
        return sock

    def fake_engine(config, checkpoint=None, **_):
        base = f"127.0.0.1:{bound[0]}"
        seen["https"] = httpx.get(f"https://{base}/health", verify=ssl.create_default_context(cafile=CERT),
                                  timeout=10).status_code
        with pytest.raises(httpx.HTTPError):  # a TLS server closes a plain-text request
            httpx.get(f"http://{base}/health", timeout=10)
        raise ConfigError("fake load failure")

    monkeypatch.setattr(radiance.server.cli, "listening_socket", recording_socket)
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", fake_engine)
    with caplog.at_level(logging.INFO, logger="radiance.server.cli"):
        assert main(["serve", "--port", "0", "--ssl-keyfile", KEY, "--ssl-certfile", CERT]) == 2
    assert seen["https"] == 503
    assert f"the API at https://127.0.0.1:{bound[0]} answers /health" in caplog.text


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model loaded although a flag was bad")


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", CERT], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-certfile", CERT, "--ssl-keyfile", "/nonexistent.key"], "--ssl-keyfile /nonexistent.key: cannot read it"),
    (["--ssl-certfile", KEY, "--ssl-keyfile", CERT], "are not a PEM certificate (chain) and its private key"),
])
def test_a_bad_tls_setting_is_one_line_before_the_model_loads(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", _must_not_load)
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _preflight(url, origin):
    return httpx.options(f"{url}/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost:3000", True), ("http://127.0.0.1:8080", True), ("http://[::1]:5173", True),
    ("https://localhost", True), ("https://evil.example", False), ("http://localhost.evil.example", False),
])
def test_local_pages_may_call_the_api_by_default_and_others_may_not(origin, allowed):
    with serve_engine(FakeEngine(), api_key="sk-test") as url:
        pre = _preflight(url, origin)
        assert (pre.status_code == 200) == allowed, pre.text
        # the answer itself: readable by an allowed page (the 401 too, so it can say why), not by another
        r = httpx.post(f"{url}/v1/chat/completions", headers={"Origin": origin}, timeout=10,
                       json={"model": "fake", "messages": [{"role": "user", "content": "SAY:hi"}]})
        assert r.status_code == 401
        assert (r.headers.get("access-control-allow-origin") == origin) == allowed
        ok = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                        headers={"Origin": origin, "Authorization": "Bearer sk-test"},
                        json={"model": "fake", "messages": [{"role": "user", "content": "SAY:hi"}]})
        assert ok.status_code == 200
        if allowed:
            assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()


@pytest.mark.parametrize("allowed_origins, origin, allowed", [
    (("https://chat.example.com",), "https://chat.example.com", True),
    (("https://chat.example.com",), "http://localhost:3000", False),  # the list replaces the local default
    (("*",), "https://anywhere.example", True),
])
def test_allowed_origins_replace_the_local_default(allowed_origins, origin, allowed):
    with serve_engine(FakeEngine(), allowed_origins=allowed_origins) as url:
        assert (_preflight(url, origin).status_code == 200) == allowed
