"""vLLM's `bench serve --backend` names for the routes radiance serves, and how --backend and --endpoint combine.

In vLLM (vllm/benchmarks/lib/endpoint_request_func.py) the backend picks the request's body and --endpoint its URL
(default /v1/completions): openai and vllm send a completions body, openai-chat a chat body to a URL that must end
in chat/completions. Kept apart from the load generator so that the CLI imports it without httpx."""

from __future__ import annotations

from radiance.errors import ConfigError

# vLLM's generation backends: the route each one's body is for
VLLM_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ROUTE_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# vLLM's other backends and where they send, none of which radiance serves
_OTHER_BACKENDS = {
    "openai-audio": "/v1/audio/transcriptions", "openai-embeddings": "/v1/embeddings",
    "openai-embeddings-chat": "/v1/embeddings", "openai-embeddings-clip": "/v1/embeddings",
    "openai-embeddings-vlm2vec": "/v1/embeddings", "infinity-embeddings": "/embeddings",
    "infinity-embeddings-clip": "/embeddings", "vllm-pooling": "/pooling", "vllm-rerank": "/rerank",
}


def check_backend(backend: str, endpoint: str) -> None:
    """A backend radiance drives, whose body suits the route `endpoint` (completions or chat); vLLM fails every
    request of a mismatch (or refuses it: openai-chat to a URL not ending in chat/completions)."""
    route = VLLM_BACKENDS.get(backend)
    if route is None:
        other = _OTHER_BACKENDS.get(backend)
        why = (f"vLLM's {backend} backend sends {other} requests, which radiance does not serve" if other
               else "not one of vLLM's backends")
        raise ConfigError(f"--backend {backend}: {why}; radiance drives {', '.join(VLLM_BACKENDS)}")
    if route == endpoint:
        return
    if route == "chat":
        raise ConfigError(f"--backend {backend} sends chat requests, whose URL must end in chat/completions, but "
                          f"--endpoint is {ROUTE_PATHS[endpoint]} (vLLM's default): give --endpoint "
                          f"{ROUTE_PATHS['chat']}, as vLLM needs it too")
    raise ConfigError(f"--backend {backend} sends completions requests, but --endpoint is the {endpoint} route "
                      f"{ROUTE_PATHS[endpoint]} (vLLM fails every request so): give --backend openai-chat")


def result_backend(backend: str | None, endpoint: str) -> str:
    """The result's "backend" (and "endpoint_type"): the --backend given, else the one vLLM would need."""
    return backend or ("openai-chat" if endpoint == "chat" else "openai")
