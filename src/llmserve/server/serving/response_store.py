"""The responses that `/v1/responses` keeps, for `previous_response_id`, GET/DELETE
`/v1/responses/{id}` and `GET /v1/responses/{id}/input_items`: bounded, in memory, least
recently used first out; and the background responses still running, for `cancel`.

A stored response holds the object the client got and the conversation it ended: every input
item of the responses it continued (not their `instructions`, which OpenAI does not carry over),
its own input items, then its output items. A request with `previous_response_id` starts from
that conversation. Its own input items are also kept as OpenAI lists them (each with an id, text
content as parts). Nothing survives a restart; `store: false` responses are never put here.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from llmserve.server.errors import APIError
from llmserve.server.serving.responses_events import new_id

# an input item's id prefix, by type (as OpenAI's ids read)
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as the client got it (GET answers it; a background response's
    object changes in place as it runs)."""
    conversation: list[dict[str, Any]]
    """The input items of this response and those it continued, then its output items."""
    input_items: list[dict[str, Any]] = field(default_factory=list)
    """This response's own input items, as `input_items` lists them."""


class ResponseStore:
    """At most `capacity` responses by id; adding one more drops the least recently used."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.running: dict[str, asyncio.Task[None]] = {}
        """Background responses still generating, by id (`cancel` stops them)."""

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


def listed_input_items(given: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input items as OpenAI lists them: each with an id (its own, or a new one)
    and a status, a message's text content as parts (`input_text`; `output_text` for assistant)."""
    out = []
    for item in given:
        kind = item.get("type", "message")
        listed = {**item, "type": kind, "id": item.get("id") or new_id(_ID_PREFIX.get(kind, "item")),
                  "status": item.get("status") or "completed"}  # fmt: skip
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            text = {"type": part, "text": item["content"]}
            listed["content"] = [{**text, "annotations": []} if part == "output_text" else text]
        out.append(listed)
    return out


def page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's cursor list over `items` (oldest first): `order` desc starts from the newest;
    `after` an item id in that order; at most `limit` (1 to 100) items."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100; got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc'; got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = 0
    if after is not None:
        if after not in ids:
            raise APIError(400, f"after: no input item with id {after!r} in this response", param="after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list", "data": data, "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < len(ordered),
    }  # fmt: skip
