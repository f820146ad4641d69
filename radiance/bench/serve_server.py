"""What `radiance bench serve` asks of the server before it measures: its root URL, the model it serves, and (with
--ready-check-timeout-sec) whether it has finished loading."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

READY_RETRY_S = 5.0  # vLLM's wait_for_endpoint retries its test request this often


def server_root(url: str) -> str:
    """--url without a trailing slash or /v1 (the openai client's base_url, which users pass here too: the
    requests went to .../v1/v1/...)."""
    root = url.rstrip("/")
    return root[:-len("/v1")] if root.endswith("/v1") else root


async def discover_model(client: httpx.AsyncClient) -> str:
    where = f"{str(client.base_url).rstrip('/')}/v1/models"  # httpx keeps a trailing slash on base_url
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:  # nothing listens there: --model would not help ("pass --model" said so)
        raise ConfigError(f"could not reach the server at {where} ({type(exc).__name__}: {exc})") from None
    if resp.status_code != 200:  # one line: httpx's own message adds a second with a link
        hint = {401: "; pass its key with --api-key", 404: "; is --url an OpenAI-compatible server?"}.get(
            resp.status_code, "; pass --model")
        raise ConfigError(f"could not list the server's models at {where} (HTTP {resp.status_code}: "
                          f"{' '.join(resp.text.split())[:200]}){hint}")
    try:
        model = resp.json()["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError):
        model = None
    if not isinstance(model, str) or not model:
        raise ConfigError(f"the server's model list at {where} names no model ({' '.join(resp.text.split())[:120]}); "
                          "pass --model")
    return model


async def wait_until_healthy(client: httpx.AsyncClient, timeout_s: float) -> None:
    """GET /health every READY_RETRY_S until it answers 200 (radiance serve and vLLM answer 503 while loading), for
    up to timeout_s; a server without the route (404, 405) is taken as ready. vLLM's ready check needs no server
    before its test request (it tokenizes on the client); radiance's lengths ask the server's /tokenize first."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            status = (await client.get("/health")).status_code
            last = f"HTTP {status}"
        except httpx.HTTPError as exc:
            status, last = None, f"{type(exc).__name__}: {exc}"
        if status in (200, 404, 405):
            return
        left = deadline - time.perf_counter()
        if left <= 0:
            raise ConfigError(f"the server was not ready within --ready-check-timeout-sec {timeout_s:g} "
                              f"(/health: {last})")
        logger.warning("Endpoint is not ready (/health: %s); retrying", last)
        await asyncio.sleep(min(READY_RETRY_S, left))
