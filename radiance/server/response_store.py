"""Responses kept in memory so a follow-up can name one (`previous_response_id`) and a client can read it
back (`GET /v1/responses/{id}`): the last `capacity` stored, oldest dropped first. Nothing survives a
restart, as in vLLM's in-memory store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict  # the response object as it was answered
    conversation: list[dict]  # chat messages without instructions: the input turns, then the model's answer


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
            return self._items.pop(response_id, None) is not None
