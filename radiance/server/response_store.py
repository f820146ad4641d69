"""Responses kept in memory so a follow-up can name one (`previous_response_id`) and a client can read it
back (`GET /v1/responses/{id}`, its input items from `GET /v1/responses/{id}/input_items`): the last
`capacity` stored, oldest dropped first. Nothing survives a restart, as in vLLM's in-memory store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class StoredResponse:
    body: dict  # the response object as it was answered
    conversation: list[dict]  # chat messages without instructions: the input turns, then the model's answer
    # the items that made its context, as input_items lists them: those of previous_response_id's context
    # and its output, then this request's input (each with an id)
    input_items: list[dict] = field(default_factory=list)
    # set when DELETE removed it: a stream still running (it stored an in-progress body) must not put it back
    deleted: bool = False

    @property
    def in_progress(self) -> bool:
        return self.body.get("status") == "in_progress"

    def input_items_page(self, order: str, after: str | None, limit: int) -> dict | None:
        """One page of input_items (OpenAI's list object), `after` the item with that id in `order`; None
        when no input item has the id `after`."""
        items = self.input_items if order == "asc" else self.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                return None
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        stored.deleted = True
        return True
