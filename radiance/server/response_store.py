"""Responses kept in memory so a follow-up can name one (`previous_response_id`) and a client can read it
back (`GET /v1/responses/{id}`, its input items from `GET /v1/responses/{id}/input_items`): the last
`capacity` stored within `max_bytes`, oldest dropped first. Nothing survives a restart, as in vLLM's in-memory store.
"""

from __future__ import annotations

import json
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
    # the JSON sizes of conversation's and input_items' items, set by stored_bytes (a follow-up reuses them)
    _item_sizes: tuple[list[int], list[int]] | None = field(default=None, repr=False, compare=False)

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


def stored_bytes(stored: StoredResponse, previous: StoredResponse | None = None) -> int:
    """What `stored` counts against the store's byte budget: the UTF-8 length of the JSON text of its body,
    conversation and input items, `json.dumps([body, conversation, input_items])`. Each keeps a chain's whole
    history, so this is what grows; Python holds such objects in a few times that, and a chain's links share the
    dicts they have in common: memory stays within a small factor of the budget.

    Measured item by item: a conversation or input item that is `previous`'s own (the same object: a follow-up's
    history) counts at the size measured for it there, so a link costs the time of what it adds. Encoding a whole
    128 MB history held the event loop 0.4-1 s per link (json's C encoder keeps the GIL, so a thread did not help)."""
    known = previous._item_sizes if previous is not None and previous._item_sizes is not None else None
    try:
        body = _json_size(stored.body)
        conversation = _sizes(stored.conversation, previous.conversation if known else [], known[0] if known else [])
        items = _sizes(stored.input_items, previous.input_items if known else [], known[1] if known else [])
    except (ValueError, RecursionError):  # a cycle, or nested deeper than JSON parsing allows: not kept
        return 1 << 62
    stored._item_sizes = (conversation, items)
    return 2 + body + 2 + _list_size(conversation) + 2 + _list_size(items)  # "[" body ", " [...] ", " [...] "]"


def _json_size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def _sizes(items: list, known_items: list, known_sizes: list[int]) -> list[int]:
    """Each item's JSON size: known_sizes[i] where the item is known_items[i] itself, else measured."""
    return [known_sizes[i] if i < len(known_sizes) and item is known_items[i] else _json_size(item)
            for i, item in enumerate(items)]


def _list_size(sizes: list[int]) -> int:
    """The JSON size of a list whose items have these sizes: brackets and ", " between items."""
    return 2 + sum(sizes) + 2 * max(len(sizes) - 1, 0)


@dataclass
class _Kept:
    stored: StoredResponse
    size: int  # stored_bytes(stored)
    charge: int  # what it counts against the budget: `size`, or what it adds to its kept previous response
    previous_id: str | None  # the kept response it continues (shares the history of), if any
    followers: set[str] = field(default_factory=set)  # kept responses that continue it


class ResponseStore:
    """The last `capacity` responses within `max_bytes`, the oldest dropped first (the count alone let long chains
    pin unbounded memory). A follow-up (previous_response_id) holds its predecessor's history by reference, so it
    is charged only what it adds while the predecessor is kept, and its whole stored_bytes once that is dropped (a
    chain of n links would otherwise count its history n times). A response over `max_bytes` alone is not kept: a
    follow-up naming it finds no response, as for one dropped."""

    def __init__(self, capacity: int, max_bytes: int):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, _Kept] = OrderedDict()
        self.bytes = 0  # the charges of the responses kept, summed
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.max_bytes > 0

    def limits(self) -> str:
        """The limits as a 404 tells them."""
        size = f"{self.max_bytes / (1 << 20):g} MiB" if self.max_bytes >= 1 << 20 else f"{self.max_bytes} bytes"
        return f"the last {self.capacity} responses within {size}"

    def put(self, response_id: str, stored: StoredResponse, previous_id: str | None = None) -> bool:
        """Keeps `stored` under `response_id`, in place of what it had; `previous_id`: the response it continues.
        False when `stored` alone is over max_bytes: not kept, and what the id had dropped (a stale in-progress
        body must not stay)."""
        if not self.enabled:
            return False
        previous = self.get(previous_id) if previous_id is not None else None
        size = stored_bytes(stored, previous)  # outside the lock: it measures what `stored` adds to `previous`
        with self._lock:
            self._pop(response_id)
            if size > self.max_bytes:
                return False
            previous = self._items.get(previous_id) if previous_id is not None else None
            if previous is not None:
                previous.followers.add(response_id)
                charge = max(size - previous.size, 0)
            else:
                previous_id, charge = None, size
            self._items[response_id] = _Kept(stored, size, charge, previous_id)
            self.bytes += charge
            while len(self._items) > self.capacity or self.bytes > self.max_bytes:
                self._pop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            kept = self._items.get(response_id)
        return kept.stored if kept is not None else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._pop(response_id)
        if stored is None:
            return False
        stored.deleted = True
        return True

    def __len__(self) -> int:
        return len(self._items)

    def _pop(self, response_id: str) -> StoredResponse | None:
        """Drops `response_id` (the lock held): the responses that continue it now hold its history alone, and
        are charged their whole size."""
        kept = self._items.pop(response_id, None)
        if kept is None:
            return None
        self.bytes -= kept.charge
        if kept.previous_id in self._items:
            self._items[kept.previous_id].followers.discard(response_id)
        for follower_id in kept.followers:
            follower = self._items.get(follower_id)
            if follower is not None and follower.previous_id == response_id:
                self.bytes += follower.size - follower.charge
                follower.charge, follower.previous_id = follower.size, None
        return kept.stored
