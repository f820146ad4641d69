"""Pieces of the API's response bodies that several routes build: ids, timestamps, usage, a model card."""

from __future__ import annotations

import hashlib
import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """A chat / completions usage. `cached_tokens` (the prompt tokens found in the prefix cache) goes out as
    prompt_tokens_details whenever it is known, 0 included, as OpenAI always sends it and vLLM with
    --enable-prompt-tokens-details does: a client reads a number whether or not the prompt hit the cache (the
    details came only with a hit before, so `usage.prompt_tokens_details.cached_tokens` failed on a miss). None (a
    continuous_usage_stats chunk, as vLLM's) leaves the details out."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def model_card(name: str, root: str, created: int, max_model_len: int | None, parent: str | None = None) -> dict:
    """A /v1/models entry in vLLM's shape: `root` the model served (its path or hub id; an adapter's path),
    `parent` null for a base model (a LoRA adapter's: the base's served name), the context length, and one
    permission object (OpenAI's old shape, which clients of vLLM may read). The permission's id and time are the
    card's own, so every answer gives the same card."""
    permission = {"id": f"modelperm-{hashlib.sha256(f'{name}:{created}'.encode()).hexdigest()[:32]}",
                  "object": "model_permission", "created": created, "allow_create_engine": False,
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": created, "owned_by": "radiance", "root": root, "parent": parent,
            "max_model_len": max_model_len, "permission": [permission]}
