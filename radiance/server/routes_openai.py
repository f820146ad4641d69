"""OpenAI's API: /v1/models, /v1/chat/completions, /v1/completions, and /v1/responses with its stored responses; and
SageMaker's /invocations, which serves a chat completion or a completion by the body's shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from radiance.server.errors import invalid
from radiance.server.protocol import ChatCompletionRequest, CompletionRequest
from radiance.server.response_bodies import model_card
from radiance.server.protocol_responses import ResponsesRequest
from radiance.server.routes_common import State
from radiance.server.serving_chat import create_chat_completion
from radiance.server.serving_completions import create_completion
from radiance.server.serving_responses import create_response, stored_input_items, stored_response
from radiance.server.state import ServerState, default_model_name

router = APIRouter()


def _card(state: ServerState, name: str) -> dict:
    lora = None if name in state.served_names else state.adapters.get(name)
    if lora is not None:  # vLLM's adapter card: root its path, parent the base's (first) served name
        return model_card(name, lora.lora_path, state.adapters.created(name), state.max_model_len or None,
                          parent=state.served_names[0])
    # the model served, whatever names it is served under (vLLM's root: its --model); while loading, no length yet
    root = state.model_path or default_model_name(None, state.engine)
    return model_card(name, root, state.created, state.max_model_len or None)


@router.get("/v1/models")
async def list_models(state: State):
    """The base model under each served name, then each LoRA adapter (vLLM's order)."""
    names = [*state.served_names, *state.adapters.names()]
    return {"object": "list", "data": [_card(state, name) for name in names]}


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


# what /invocations serves, by the field that tells the body's kind: vLLM's order (chat first), of the kinds radiance
# serves (vLLM's list goes on with embeddings, classification, scores and pooling)
_INVOCATIONS = (("messages", ChatCompletionRequest, create_chat_completion),
                ("prompt", CompletionRequest, create_completion))


@router.post("/invocations")
async def invocations(body: Annotated[dict[str, Any], Body()], request: Request, state: State):
    """SageMaker's inference route: a body with `messages` is a chat completion, one with `prompt` a completion, served
    as its /v1 route serves it (streaming, errors, API key). vLLM tries each request type in turn and takes the first
    that validates, so a chat request with one bad field there was "Cannot find suitable handler"; here it is that
    route's own 400, naming the field."""
    for field, model, serve in _INVOCATIONS:
        if field in body:
            try:
                parsed = model.model_validate(body)
            except ValidationError as exc:  # answered by errors.py as the route's own body validation is
                raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                              for e in exc.errors(include_url=False)], body=body) from None
            return await serve(state, parsed, request)
    raise invalid("an /invocations body is a chat completion request (with messages) or a completion request "
                  "(with prompt): it has neither")
