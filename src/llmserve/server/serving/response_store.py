"""The responses that `/v1/responses` keeps, for `previous_response_id` and GET/DELETE
`/v1/responses/{id}`: bounded, in memory, least recently used first out.

A stored response holds the object the client got and the conversation it ended: every input
item of the responses it continued (not their `instructions`, which OpenAI does not carry over),
its own input items, then its output items. A request with `previous_response_id` starts from
that conversation. Nothing survives a restart; `store: false` responses are never put here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as the client got it (GET answers it)."""
    conversation: list[dict[str, Any]]
    """The input items of this response and those it continued, then its output items."""


class ResponseStore:
    """At most `capacity` responses by id; adding one more drops the least recently used."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        key = stored.response["id"]
        self._items[key] = stored
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
