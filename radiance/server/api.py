"""The FastAPI app: the middleware every request passes through, background model loading, and the routes
(routes_ops, routes_openai, routes_tokenizer; routes_lora with --allow-runtime-lora-updating) assembled.

`build_app(state)` returns an app whose lifespan starts loading the engine in a worker thread, so
the port is open (and `/health` answers 503) while weights load. /health, /ping, /metrics and /version
stay public when an API key is set; everything else (SageMaker's /invocations too) needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import uuid

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from radiance import __version__

from radiance.server import routes_lora, routes_openai, routes_ops, routes_tokenizer
from radiance.server.errors import JSONAnswer, OpenAIError, error_response, install_error_handlers, internal_error
from radiance.server.metrics import ServedRequest, current_request
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)

# public: the probes and the operator's read-outs. Everything else needs the key, SageMaker's /invocations too (it
# generates as /v1/chat/completions does); vLLM checks the key on /v1 paths only, which left /invocations open to
# anyone who can reach the port. SageMaker authenticates its callers itself (IAM) and sends the container no bearer
# key: a server behind it runs without --api-key.
PUBLIC_PATHS = ("/health", "/metrics", "/version", "/ping")
PROBE_PATHS = ("/health", "/ping")  # their 503 says "not ready" (loading): no failed request for the error counts

# the web pages a browser lets call the API when no --allowed-origins are given: this machine's own (a local chat
# UI), not any site the user happens to visit (a local server is otherwise open to every page, as Ollama found)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def cors_options(allowed_origins: tuple[str, ...]) -> dict:
    """CORSMiddleware's options: the origins given (`*`: any), else local pages only. Any header (the OpenAI SDKs
    send x-stainless-*), no cookies (the API key travels in Authorization); pages may read X-Request-Id."""
    origins = {"allow_origins": ["*"]} if "*" in allowed_origins else (
        {"allow_origins": list(allowed_origins)} if allowed_origins else {"allow_origin_regex": LOCAL_ORIGINS})
    return {**origins, "allow_methods": ["GET", "POST", "DELETE"], "allow_headers": ["*"],
            "expose_headers": ["X-Request-Id"], "allow_credentials": False}


_CLIENT_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class RequestMiddleware:
    """What every request passes through: the API-key check, the request id, the error counts, the last-resort
    answer. Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through
    untouched; counts error statuses for /metrics, and answers what a route left unanswered (a bug: 500;
    cancelled by the server's shutdown: 503) as an OpenAI-shaped error. Every answer carries X-Request-Id: the
    client's own (as vLLM honours it) or a new one; log lines written while serving the request are tagged
    with it (cli.RequestIdLogFilter)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        served = self._served_request(scope)
        token = current_request.set(served)
        try:
            await self._serve(scope, receive, self._sending_request_id(send, served.request_id))
        finally:
            current_request.reset(token)

    async def _answer(self, scope, receive, send):
        if not self._authorized(scope):  # a 401, counted by _serve as every error status
            response = error_response(OpenAIError(401, "Incorrect or missing API key "
                                                       "(send Authorization: Bearer KEY)", code="invalid_api_key"))
            return await response(scope, receive, send)
        encoding = dict(scope.get("headers") or ()).get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):  # read as JSON it would be "not UTF-8": say what is wrong
            response = error_response(OpenAIError(415, f"Content-Encoding {encoding.decode('latin-1')} is not "
                                                       "supported: send the request body uncompressed"))
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    @staticmethod
    def _served_request(scope) -> ServedRequest:
        """The client's X-Request-Id when it is a plain id (visible ASCII, at most 128 characters), else a new
        one: the id becomes part of response bodies and log lines, where a 5,000-character or non-ASCII header
        (read as latin-1: mojibake) has no place."""
        for name, value in scope.get("headers") or ():
            if name == b"x-request-id" and _CLIENT_REQUEST_ID.fullmatch(value):
                return ServedRequest(value.decode("ascii"))
        return ServedRequest(uuid.uuid4().hex)

    @staticmethod
    def _sending_request_id(send, request_id: str):
        async def send_with_request_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        return send_with_request_id

    def _authorized(self, scope) -> bool:
        key = self.state.config.api_key
        if not key or scope["path"] in PUBLIC_PATHS:
            return True
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode(), key.encode())

    async def _serve(self, scope, receive, send):
        status = None
        sent_all = client_left = False

        async def watching_receive():
            nonlocal client_left
            message = await receive()
            # the server reports a disconnect after the last body too: only one before it is a client that left
            client_left = client_left or message["type"] == "http.disconnect" and not sent_all
            return message

        async def counting_send(message):
            nonlocal status, sent_all
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400 and scope["path"] not in PROBE_PATHS:
                    self.state.metrics.http_error(status)
            sent_all = sent_all or message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await self._answer(scope, watching_receive, counting_send)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs once its graceful-shutdown timeout is over (and awaits it no more):
            # the client gets a 503 (not uvicorn's text/plain 500), the log no "Exception in ASGI application"
            asyncio.current_task().uncancel()
            if status is None:
                await error_response(OpenAIError(503, "the server is shutting down"))(scope, receive, counting_send)
        except Exception as exc:
            # the one place a bug is answered (errors.py has no Exception handler): Starlette's sits outside this
            # middleware and re-raises, so uvicorn logged the traceback a second time and closed the keep-alive
            # connection (test_an_unexpected_exception_is_answered_by_the_middleware_alone)
            logger.exception("internal error while serving %s", scope["path"])
            if status is None:
                await error_response(internal_error(exc))(scope, receive, counting_send)
        finally:
            self._count_stream_error(status, client_left)

    def _count_stream_error(self, status: int | None, client_left: bool) -> None:
        """A stream that failed after its 200 went out reported the error in-band (errors.sse_error): counted
        as an error answer of that status, which /metrics otherwise never saw; one whose client left as 499, as
        a non-streaming request whose client left is answered."""
        in_band = current_request.get().stream_error_status
        if status is not None and status < 400 and in_band is not None:
            if client_left:  # as a non-streaming request's disconnect is logged (collect_until_disconnect)
                logger.info("client disconnected; stream aborted")
            self.state.metrics.http_error(499 if client_left else in_band)


def _lifespan(on_ready, on_load_failure):
    """Loads the engine in the background while the server runs (the port is open meanwhile), stops it after."""

    async def load(state: ServerState):
        try:
            await state.load()
        except asyncio.CancelledError:  # stopped while loading (Ctrl+C): nothing failed
            return
        except BaseException:  # noqa: BLE001 - logged by state.load; /health reports it
            if on_load_failure is not None:
                on_load_failure(state)
            return
        if on_ready is not None:
            on_ready(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state = app.state.radiance
        task = asyncio.create_task(load(state)) if not state.ready else None
        yield
        if task is not None and not task.done():
            task.cancel()
        # the engine's loop and threads stop with the server: a stream still waiting ends instead of hanging
        await state.shutdown()

    return lifespan


def build_app(state: ServerState, on_ready=None, on_load_failure=None) -> FastAPI:
    """`on_ready(state)` runs once the engine is loaded (the CLI logs the startup summary there);
    `on_load_failure(state)` when loading raised (the CLI shuts the server down and reports it)."""
    app = FastAPI(title="radiance", version=__version__, lifespan=_lifespan(on_ready, on_load_failure),
                  default_response_class=JSONAnswer)  # the routes that answer a dict (a stored response, ...)
    app.state.radiance = state  # the routes' State dependency (routes_common) reads it
    install_error_handlers(app)

    app.add_middleware(RequestMiddleware, state=state)
    # added last, so outermost: a browser's preflight (no Authorization header) is answered before the key check,
    # and a 401 carries the CORS headers the page needs to read it
    app.add_middleware(CORSMiddleware, **cors_options(state.config.allowed_origins))

    for router in (routes_ops.router, routes_openai.router, routes_tokenizer.router):
        app.include_router(router)
    if state.config.allow_runtime_lora_updating:  # else unknown routes (404), as vLLM leaves them out
        logger.warning("LoRA adapters can be loaded and unloaded at runtime (/v1/load_lora_adapter): this loads any "
                       "adapter path the server can read, for anyone who may call the API")
        app.include_router(routes_lora.router)
    return app
