"""The Responses store's pure parts: input items as OpenAI lists them, and its cursor pages."""

from __future__ import annotations

import pytest

from llmserve.server.errors import APIError
from llmserve.server.serving.response_store import listed_input_items, page


def test_listed_input_items_get_ids_statuses_and_text_parts() -> None:
    given = [
        {"type": "message", "role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "id": "msg_given"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1", "status": "incomplete"},
    ]
    items = listed_input_items(given)
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "fc", "fco"]
    assert items[1]["id"] == "msg_given" and items[1]["type"] == "message"
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert [i["status"] for i in items] == ["completed", "completed", "completed", "incomplete"]
    assert given[0]["content"] == "hi"  # the conversation's own items are left as they were


ITEMS = [{"id": f"i{n}"} for n in range(5)]


@pytest.mark.parametrize(
    ("after", "limit", "order", "ids", "has_more"),
    [
        (None, 20, "desc", ["i4", "i3", "i2", "i1", "i0"], False),
        (None, 2, "asc", ["i0", "i1"], True),
        ("i1", 2, "asc", ["i2", "i3"], True),
        ("i3", 2, "asc", ["i4"], False),
        ("i4", 3, "desc", ["i3", "i2", "i1"], True),
        ("i0", 5, "desc", [], False),
    ],
)
def test_page(after: str | None, limit: int, order: str, ids: list[str], has_more: bool) -> None:
    got = page(ITEMS, after, limit, order)
    assert [i["id"] for i in got["data"]] == ids and got["has_more"] is has_more and got["object"] == "list"
    assert (got["first_id"], got["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))


@pytest.mark.parametrize(
    ("after", "limit", "order", "param"), [(None, 0, "asc", "limit"), (None, 101, "asc", "limit"),
                                           (None, 1, "up", "order"), ("nope", 1, "asc", "after")]
)  # fmt: skip
def test_page_refuses_bad_queries(after: str | None, limit: int, order: str, param: str) -> None:
    with pytest.raises(APIError) as e:
        page(ITEMS, after, limit, order)
    assert e.value.status == 400 and e.value.param == param
