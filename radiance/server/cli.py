"""`radiance serve [MODEL]`: the OpenAI-compatible server on FastAPI + uvicorn.

Every engine config field is a flag (`radiance.config_cli.add_engine_args`), as is every ServerConfig
field. The port opens at once; the model loads in the background (`/health` says 503 until it is
ready), then the startup summary is logged: model, quantization, kernels, KV cache size, URL.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys

from radiance.config import ServerConfig
from radiance.config_cli import add_dataclass_args, add_engine_args, config_from_args, engine_config_from_args
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF checkpoint directory, a GGUF file or a Hugging Face Hub id; default: the "
                    "embedded SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.")
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory, .gguf file, or Hugging Face Hub id: org/name, org/name@revision, "
                             "org/name:TAG for the GGUF file of a repo whose name has TAG (fetched into the Hub's "
                             "cache once; default: the embedded SmolLM2)")
    add_engine_args(parser)
    add_dataclass_args(parser, ServerConfig, group="server options")
    _add_vllm_flags(parser)
    parser.set_defaults(func=run_serve)


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that a `vllm serve` command line carries and radiance needs no setting for, so that such a
    command line runs as it is (each would be "unrecognized arguments" otherwise)."""
    group = parser.add_argument_group("vLLM flags accepted for its command lines")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="no effect: tool calls are parsed whenever a tool-call parser serves (--tool-call-parser)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="no effect: radiance runs no code that a checkpoint ships")
    group.add_argument("--disable-log-requests", "--no-enable-log-requests", action="store_true",
                       help="no effect: requests are not logged one by one")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="only 1, the default: radiance serves a model on one device")


def configs_from_args(args: argparse.Namespace):
    """(EngineConfig, ServerConfig); bad values become ConfigError (one line, exit 2)."""
    given_model = getattr(args, "model", None)
    if args.model_path and given_model and args.model_path != given_model:
        raise ConfigError(f"two models given: positional {args.model_path!r} and --model {given_model!r}")
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ConfigError(f"--tensor-parallel-size {args.tensor_parallel_size}: radiance serves a model on one "
                          "device (leave it out or 1)")
    engine_config = engine_config_from_args(args, model=args.model_path)
    server_config = config_from_args(args, ServerConfig)
    _check_before_loading(engine_config, server_config)
    return engine_config, server_config


def _check_before_loading(engine_config, server_config: ServerConfig) -> None:
    """What can be checked without the model: otherwise the mistake surfaces after a load that may take minutes."""
    from radiance.engine.devices import resolve_device

    resolve_device(engine_config.model.device)
    _check_chat_template(server_config.chat_template)
    _check_parsers(server_config)
    _check_tls(server_config)


def _warn_of_templates_that_do_not_parse(checkpoint) -> None:
    """The model's own templates are compiled before it loads: one that does not parse is said once at startup,
    naming its file (chat requests then fail with the same words; completions still serve)."""
    from radiance.server.chat_template import template_errors

    for name, exc in template_errors(checkpoint):
        which = "" if name == "default" else f" ({name!r} template)"
        logger.warning("%s%s: chat requests using it will fail (--chat-template gives another)", exc, which)


def _check_tls(server_config: ServerConfig) -> None:
    """The key and certificate load (uvicorn would fail on them only at startup, with a traceback)."""
    if server_config.ssl_certfile is None:
        return
    import ssl

    certfile, keyfile = server_config.ssl_certfile, server_config.ssl_keyfile
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            open(path, "rb").close()
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot read it: {exc.strerror}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:  # OpenSSL's own words ("[SSL] PEM lib (_ssl.c:3905)") name neither file
        detail = f" ({exc.reason})" if exc.reason else ""
        raise ConfigError(f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile} are not a PEM certificate (chain) "
                          f"and its private key{detail}") from None


def _check_parsers(server_config: ServerConfig) -> None:
    """Harmony tool calls are read by the harmony reasoning parser (ServerState._check_harmony_calls); a flag
    that rules it out is known to fail before the model loads."""
    reasoning = server_config.reasoning_parser
    if server_config.tool_call_parser == "harmony" and reasoning not in ("harmony", "auto"):
        raise ConfigError("--tool-call-parser harmony needs the harmony reasoning parser (--reasoning-parser "
                          f"harmony or auto with a harmony template), not {reasoning}")


def _check_chat_template(value: str | None) -> None:
    """--chat-template names a readable file (or is template text) that parses as jinja."""
    from radiance.server.chat_template import check_template, load_template

    try:
        template = load_template(value)
    except OSError as exc:  # e.g. a directory, or no permission
        raise ConfigError(f"--chat-template {value}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:  # named neither the file nor the flag
        raise ConfigError(f"--chat-template {value}: the file is not UTF-8 text") from None
    if template is not None:
        check_template(template)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so a bad --host or a taken --port is one line at once
    (uvicorn binds only after its startup, and then exits with a log line and a traceback). Port 0 binds a free
    port, which the startup lines report. Bound as uvicorn binds: IPv6 when the host has a colon."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # listening at once: a client that comes while uvicorn still starts waits in the backlog instead of being
        # refused (the load runs in a thread from the lifespan's startup, before uvicorn's own listen)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    return sock


class RequestIdLogFilter(logging.Filter):
    """Tags a line logged while a request is served (uvicorn's access line included) with the request's id, the
    X-Request-Id its answer carries, so a client's id finds its lines in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        from radiance.server.metrics import current_request

        served = current_request.get()
        if served is not None and not hasattr(record, "request_id"):  # once, whichever handler sees it first
            record.request_id = served.request_id
            if record.name == "uvicorn.access" and isinstance(record.args, tuple) and record.args:
                # uvicorn's access formatter prints its arguments, not the message: tag the client's address
                record.args = (f"[{served.request_id}] {record.args[0]}", *record.args[1:])
            else:
                tag = served.request_id.replace("%", "%%") if record.args else served.request_id  # formatted
                record.msg = f"[{tag}] {record.msg}"
        return True


@contextlib.contextmanager
def request_ids_in_logs(loggers=("", "uvicorn", "uvicorn.access", "uvicorn.error")):
    """RequestIdLogFilter on the handlers of these loggers (root's, and uvicorn's own, which do not propagate)
    while the server runs; taken off after (a process that serves twice, tests, keeps its handlers as they were)."""
    tagged = [handler for name in loggers for handler in logging.getLogger(name).handlers]
    log_filter = RequestIdLogFilter()
    for handler in tagged:
        handler.addFilter(log_filter)
    try:
        yield
    finally:
        for handler in tagged:
            handler.removeFilter(log_filter)


class GracefulTimeoutNote(logging.Filter):
    """uvicorn's ERROR "Cancel N running task(s), timeout graceful shutdown exceeded" after a shutdown signal is the
    expected end of streams still running after the 5 s grace (each gets "the server is shutting down", then
    [DONE]): an INFO line saying so, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith("Cancel %s running task(s), timeout graceful"):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "shutdown: %s request(s) still running after the 5 s grace were ended (\"the server is " \
                         "shutting down\")"
        return True


@contextlib.contextmanager
def graceful_timeout_as_info():
    """GracefulTimeoutNote on uvicorn's error logger while the server runs."""
    log_filter, uvicorn_error = GracefulTimeoutNote(), logging.getLogger("uvicorn.error")
    uvicorn_error.addFilter(log_filter)
    try:
        yield
    finally:
        uvicorn_error.removeFilter(log_filter)


def _force_quit() -> None:
    """A second Ctrl+C during uvicorn's graceful wait (its "CTRL+C to force quit"): the streams still open are cut
    and the process ends here with one line. Left to uvicorn, the re-raised signal met the lifespan task and two
    tracebacks were logged."""
    print("radiance serve: forced to quit (Ctrl+C twice); requests still running were cut", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(130)


def _exit_while_loading() -> None:
    """Ctrl+C while the weights load: the load thread cannot be interrupted, and the interpreter's exit would
    end it mid-way in native code (an abort), so the process ends here, at once, with one line."""
    print("radiance serve: interrupted while the model was loading", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def _url(host: str, port: int, tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from radiance.engine.loader import open_for_loading
    from radiance.server.api import build_app
    from radiance.server.state import ServerState

    engine_config, server_config = configs_from_args(args)
    # before the port is bound: a missing or unsupported model, or a --max-model-len past its context, is one line
    checkpoint, _, _ = open_for_loading(engine_config.model, engine_config.cache)
    if server_config.chat_template is None:
        _warn_of_templates_that_do_not_parse(checkpoint)
    sock = listening_socket(server_config.host, server_config.port)

    def make_engine():
        from radiance.engine import AsyncLLMEngine
        return AsyncLLMEngine(engine_config, checkpoint=checkpoint, progress=not args.no_progress)

    url = _url(server_config.host, sock.getsockname()[1], tls=server_config.ssl_certfile is not None)

    def on_ready(state: ServerState) -> None:
        for line in state.startup_lines():
            logger.info("%s", line)
        logger.info("ready: OpenAI-compatible API at %s/v1 (health %s/health, metrics %s/metrics)", url, url, url)

    state = ServerState(server_config, make_engine, model_path=engine_config.model.model)
    logger.info("loading %s; the API at %s answers /health with 503 until the model is ready",
                engine_config.model.model or "the embedded SmolLM2-135M-Instruct", url)
    server: uvicorn.Server | None = None

    def on_load_failure(_state: ServerState) -> None:
        server.should_exit = True  # nothing to serve: stop and report the error below

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                _force_quit()
            super().handle_exit(sig, frame)

    app = build_app(state, on_ready=on_ready, on_load_failure=on_load_failure)
    server = Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level=server_config.uvicorn_log_level, timeout_graceful_shutdown=5,
                                           ssl_keyfile=server_config.ssl_keyfile,
                                           ssl_certfile=server_config.ssl_certfile))
    try:
        with request_ids_in_logs(), graceful_timeout_as_info():  # after uvicorn.Config: it sets up its log handlers
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn stopped, then raised the SIGINT it caught
        if state.loading:
            _exit_while_loading()
        raise
    finally:
        sock.close()
    if state.loading:
        # stopped by a signal that raised nothing: a SIGINT Python ignores (`radiance serve &` in a script starts
        # with it ignored, and uvicorn hands it back to that) stopped uvicorn; returning let the interpreter's exit
        # end the load thread in native code: "terminate called without an active exception", an abort
        _exit_while_loading()
    return _load_failure_exit(state.load_error)


def _load_failure_exit(error: BaseException | None) -> int:
    """0 when the model loaded; a load error the user can fix is raised (one line, exit 2); any other was logged
    with its traceback as it happened (ServerState.load), so it is not raised to print that again: exit 1."""
    from radiance.errors import RadianceError

    if error is None:
        return 0
    if isinstance(error, (RadianceError, ValueError)):
        raise error
    return 1
