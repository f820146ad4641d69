"""The operator's routes, public when an API key is set (api.PUBLIC_PATHS): /health and /ping (SageMaker's name for it),
/version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from radiance import __version__
from radiance.server.errors import OpenAIError
from radiance.server.metrics import CONTENT_TYPE
from radiance.server.routes_common import State

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checkers' probe
async def health(state: State):
    if state.ready and not state.engine_failed():
        return Response(status_code=200)
    status = "failed" if state.load_error or state.engine_failed() else "loading"
    return JSONResponse(OpenAIError(503, f"model {status}").body(), status_code=503)


@router.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check (it sends GET; vLLM takes POST too)
async def ping(state: State):
    return await health(state)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/metrics")
async def metrics(state: State):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
