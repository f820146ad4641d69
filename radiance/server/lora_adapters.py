"""The LoRA adapters the server serves as models, vLLM's OpenAIServingModels in its LoRA part: each adapter is a
model name a request's `model` may give (its LoRARequest goes with every engine request of it), a /v1/models card
(root its path, parent the base's served name), and with --allow-runtime-lora-updating one that
/v1/load_lora_adapter adds and /v1/unload_lora_adapter takes away.

The adapters --lora-modules names are loaded by the engine as it starts (ids 1, 2, ...); the server reads them from
`engine.list_loras()` once the engine is attached, and ids of adapters loaded later continue after the largest (never
reused after an unload, as vLLM's counter: an engine request still running with an old id cannot meet a new adapter).

vLLM's `load_inplace` (a trainer pushing new weights under a served name) loads the new files under a new id and
points the name at it: the next requests get the new weights, requests already running finish on the old ones, and
a load that fails leaves the old adapter serving. The old id stays loaded until the name's next reload or its
unload, so a request that read the name just before the swap (its prompt still being rendered) runs on the old
weights rather than failing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from radiance.server.errors import OpenAIError

logger = logging.getLogger(__name__)


def _not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")


class ServedAdapters:
    """Adapter name -> its LoRARequest, in the order they were loaded (the order /v1/models lists them)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Any] = {}  # name -> LoRARequest
        self._created: dict[str, int] = {}  # name -> when it was loaded (its card's `created`)
        self._replaced: dict[str, Any] = {}  # name -> the LoRARequest its last in-place reload replaced (loaded still)
        self._next_id = 1
        # one load or unload at a time: the name checks and the engine's change happen as one step (vLLM locks per
        # name; loads are rare and an operator's, so one lock is enough)
        self._lock = asyncio.Lock()

    def attach(self, engine: Any) -> None:
        """The adapters the engine loaded as it started (--lora-modules); none for an engine without LoRA."""
        if not getattr(engine, "lora_enabled", False):
            return
        for lora in engine.list_loras():
            self._add(lora)

    def _add(self, lora: Any) -> None:
        self._by_name[lora.lora_name] = lora
        self._created[lora.lora_name] = int(time.time())
        self._next_id = max(self._next_id, lora.lora_int_id + 1)

    def get(self, name: str | None) -> Any:
        """The LoRARequest of adapter `name`; None for any other name (the base model's, or None)."""
        return self._by_name.get(name) if name is not None else None

    def for_engine(self, name: str) -> Any:
        """The LoRARequest a request for adapter `name` runs with: without its path, so an adapter unloaded after the
        request resolved its name is the engine's ValueError (a 400), not loaded again behind the server's back
        (the engine loads an unknown adapter from a request's path) where no unload would ever reach it."""
        lora = self._by_name.get(name)
        return None if lora is None else dataclasses.replace(lora, lora_path="")

    def names(self) -> list[str]:
        return list(self._by_name)

    def created(self, name: str) -> int:
        """When adapter `name` was loaded (its model card's `created`)."""
        return self._created[name]

    async def load(self, engine: Any, name: str, path: str, base_names: tuple[str, ...], inplace: bool = False) -> str:
        """Loads adapter `path` as model `name` (vLLM's answers and messages); with `inplace` a served `name` is
        reloaded from `path` (module docstring). An OpenAIError when it cannot be, the adapters served unchanged."""
        if not name or not path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if not getattr(engine, "lora_enabled", False):
            raise OpenAIError(400, "LoRA is not enabled: start the server with --enable-lora to load adapters")
        async with self._lock:
            previous = self._by_name.get(name)
            if previous is not None and not inplace:
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            if name in base_names:  # requests naming it would reach the base model, never the adapter
                raise OpenAIError(400, f"The lora adapter name '{name}' is a name of the served base model: give "
                                       "the adapter another", param="lora_name")
            from radiance.lora import LoRARequest

            lora = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path)
            self._next_id += 1  # spent even when the load fails, as vLLM's counter: ids are never reused
            try:
                await engine.add_lora(lora)
            except (ValueError, OSError) as exc:  # a bad adapter: the client's, and the server serves on
                if not os.path.exists(os.path.expanduser(path)):  # vLLM's LoRAAdapterNotFoundError: a 404, and why
                    # (a Hub id: what fetching it said, or what is wrong with what it fetched)
                    raise OpenAIError(404, f"Loading lora {name} failed: No adapter found for {path} ({exc})",
                                      param="lora_path") from None
                raise OpenAIError(400, f"Loading lora {name} failed: {exc}", param="lora_path") from None
            self._add(lora)
            if previous is not None:  # kept loaded one reload longer (module docstring)
                await self._forget_replaced(engine, name)
                self._replaced[name] = previous
        if previous is not None:
            logger.info("Reloaded LoRA adapter in place: name '%s', path '%s' (id %d; id %d kept for the requests "
                        "that read the name before)", name, path, lora.lora_int_id, previous.lora_int_id)
        else:
            logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine: Any, name: str) -> str:
        if not name:
            raise OpenAIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            lora = self._by_name.get(name)
            if lora is None:
                raise _not_found(name)
            # False: the engine holds it no more (none of its requests can run): unloaded either way
            await engine.remove_lora(lora.lora_int_id)
            await self._forget_replaced(engine, name)
            del self._by_name[name], self._created[name]
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _forget_replaced(self, engine: Any, name: str) -> None:
        """Unloads the adapter an earlier in-place reload of `name` replaced (its running requests finish on it)."""
        replaced = self._replaced.pop(name, None)
        if replaced is not None:
            await engine.remove_lora(replaced.lora_int_id)
