"""What the route modules share: the app's ServerState, as a FastAPI dependency (build_app puts it on app.state)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from radiance.server.state import ServerState


async def server_state(request: Request) -> ServerState:
    # async: FastAPI would run a plain def in its thread pool, once per request
    return request.app.state.radiance


State = Annotated[ServerState, Depends(server_state)]
