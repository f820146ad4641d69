"""OpenAI's API: /v1/models, /v1/chat/completions, /v1/completions, and /v1/responses with its stored responses."""

from __future__ import annotations

from fastapi import APIRouter, Request

from radiance.server.protocol import ChatCompletionRequest, CompletionRequest, model_card
from radiance.server.protocol_responses import ResponsesRequest
from radiance.server.routes_common import State
from radiance.server.serving_chat import create_chat_completion
from radiance.server.serving_completions import create_completion
from radiance.server.serving_responses import create_response, stored_input_items, stored_response
from radiance.server.state import ServerState

router = APIRouter()


def _card(state: ServerState, name: str) -> dict:
    root = state.model_path or state.served_names[0]
    return dict(model_card(name, root, state.created), max_model_len=state.max_model_len or None)


@router.get("/v1/models")
async def list_models(state: State):
    return {"object": "list", "data": [_card(state, name) for name in state.served_names]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, state: State):
    return _card(state, state.check_model(name))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    return await create_chat_completion(state, body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    return await create_completion(state, body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: State):
    return await create_response(state, body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State):
    return stored_response(state, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, state: State, order: str = "desc",
                           after: str | None = None, limit: int = 20):
    query = request.query_params  # the openai client sends a list as include[]=...
    include = query.getlist("include") + query.getlist("include[]")
    return stored_input_items(state, response_id, order, after, limit, include)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State):
    stored_response(state, response_id)  # 404 when unknown
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
