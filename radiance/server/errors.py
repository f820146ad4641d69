"""OpenAI-shaped errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

FastAPI's own validation answer (422 with a list of pydantic errors) is replaced by a 400 whose
`param` names the offending field, as OpenAI clients expect. Unexpected exceptions become a 500
whose body carries no traceback (the traceback goes to the server log only): api.RequestMiddleware
answers them with `internal_error`, as no exception handler here could (Starlette's for Exception runs
outside that middleware, so it never sees a route's exception).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radiance.engine.request_checks import SamplingParamsError
from radiance.errors import RadianceError
from radiance.server.metrics import current_request

# OpenAI's error types (what its API sends and its SDK documents). vLLM names them after the status
# (BadRequestError, NotFoundError); clients branch on the status, which both share
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model, URL or object (never "not_found_error")
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    500: "internal_server_error",
    501: "invalid_request_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """Raise anywhere in a route to answer with this status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        fallback = "internal_server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _TYPE_BY_STATUS.get(status, fallback)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unknown_url(method: str, path: str) -> OpenAIError:
    """OpenAI's 404 for a route it does not have."""
    return OpenAIError(404, f"Unknown request URL: {method} {path}. Please check the URL for typos.",
                       code="unknown_url")


class JSONAnswer(JSONResponse):
    """Starlette's JSONResponse (UTF-8, non-ASCII text as it is), but a string UTF-8 cannot encode, a lone UTF-16
    surrogate that a request sent ("\\ud800") and the answer echoes (a model name, metadata, user, an input item id),
    is escaped as JSON writes it, where encoding the answer raised UnicodeEncodeError: a 500 after the work was done."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def json_text(value) -> str:
    """JSON text of an event that goes out as UTF-8: non-ASCII as it is, a lone surrogate escaped (JSONAnswer)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONAnswer(err.body(), status_code=err.status)


def internal_error(exc: BaseException) -> OpenAIError:
    """A bug's answer: the exception's type, never its message or traceback (those go to the log)."""
    return OpenAIError(500, f"internal server error ({type(exc).__name__})")


def sse_error(err: OpenAIError) -> str:
    """The event a stream sends when it fails after its headers went out (then `[DONE]`); noted for /metrics,
    as the response's status (200) does not say the request failed."""
    served = current_request.get()
    if served is not None:
        served.stream_error_status = err.status
    return f"data: {json.dumps(err.body())}\n\n"


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the union branch it tried (`str`, `list[int]`, `literal[...]`, `NamedToolChoice`)
    in the error location; API field names are lower_snake_case words."""
    return any(c in part for c in "[('-") or part in _TYPE_NAMES or part[:1].isupper()


def param_from_loc(loc: tuple) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_union_tag(p):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _validation_message(exc: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "missing" and len(first.get("loc", ())) <= 1:
        return "the request body is empty: send a JSON object", None
    if isinstance(first.get("input"), (bytes, bytearray)):  # FastAPI parses JSON only when the header says so
        return ("the request body must be JSON sent with Content-Type: application/json "
                f"(got {content_type or 'none'})"), None
    if kind in ("model_attributes_type", "dict_type", "model_type") and len(first.get("loc", ())) <= 1:
        return "the request body must be a JSON object", None
    param = param_from_loc(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if kind in ("literal_error", "enum"):  # "Input should be 'a' or 'b'" said nothing of what was sent
        msg += f", got {_short_repr(first.get('input'))}"
    # strip pydantic's "Value error, " prefix from our own validators' messages
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        if param is None:  # a whole-request check: its message starts with the field it is about
            from radiance.server.protocol import ChatCompletionRequest, CompletionRequest
            param = field_named_first(msg, ChatCompletionRequest, CompletionRequest)
        return msg, param
    return (f"{param}: {msg}" if param else msg), param


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def field_named_first(message: str, *models: type) -> str | None:
    """OpenAI's `param` for a message about one field that names it first ("top_logprobs needs logprobs"): its
    first word when that is a field of one of the pydantic `models`, else None."""
    word = message.split(" ", 1)[0]
    return word if any(word in model.model_fields for model in models) else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type"))
        return error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(unknown_url(_request.method, _request.url.path))
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if message == "There was an error parsing the body":  # FastAPI's, for any body it could not decode
            message = ("the request body is not UTF-8: send UTF-8 JSON"
                       if isinstance(exc.__cause__, UnicodeDecodeError) else "the request body could not be read as JSON")
        response = error_response(OpenAIError(exc.status_code, message))
        response.headers.update(exc.headers or {})  # a 405's Allow: the methods the route takes
        return response

    @app.exception_handler(RadianceError)
    async def _radiance_error(_request: Request, exc: RadianceError):
        param = None
        if isinstance(exc, SamplingParamsError):  # its message names the field first ("min_tokens must be ...")
            from radiance.server.protocol import ChatCompletionRequest, CompletionRequest
            param = field_named_first(str(exc), ChatCompletionRequest, CompletionRequest)
        return error_response(OpenAIError(400, str(exc), param=param))
