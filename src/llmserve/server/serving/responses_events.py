"""OpenAI's Responses shapes, from an answer's pieces (serving/pieces.py): the response object,
and its stream of semantic events. One class builds both, so a streamed response ends with the
very object a whole one is (the whole one is the same events, with the answer as one piece).

A response's output is a list of items, in the order the model wrote them: a `reasoning` item
(the `<think>` part), a `message` with one `output_text` part, then one `function_call` item per
call. Streamed, each item opens, takes its deltas and closes before the next one opens; every
event carries `sequence_number` (0, 1, 2, ...):

    response.created, response.in_progress                  {"response": {... "status": "in_progress"}}
    response.output_item.added       {"output_index": 0, "item": {"type": "reasoning", ...}}
    response.content_part.added      {"part": {"type": "reasoning_text", "text": ""}}
    response.reasoning_text.delta    {"delta": "..."}                                  (many)
    response.reasoning_text.done, response.content_part.done, response.output_item.done
    response.output_item.added       {"output_index": 1, "item": {"type": "message", "content": []}}
    response.content_part.added      {"part": {"type": "output_text", "text": ""}}
    response.output_text.delta       {"delta": "..."}                                  (many)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added       {"output_index": 2, "item": {"type": "function_call", "arguments": ""}}
    response.function_call_arguments.delta, .done, response.output_item.done
    response.completed (or response.incomplete: max_output_tokens cut it)   {"response": {...}}

A function call's item opens as soon as the model has written the call's name, and its
arguments stream as `response.function_call_arguments.delta`s while the model writes them (the
pieces' call deltas, tool_stream.py); a call that cannot stream comes whole when the answer ends,
as one delta. A call that max_output_tokens cuts after its item opened closes `incomplete`, and
so does the response. An error after the stream began is an `error` event, then
`response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from llmserve.server.errors import APIError
from llmserve.server.serving.pieces import End, Piece


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(end: End | None, num_prompt_tokens: int | None) -> dict[str, Any]:
    n_in = (end.prompt_eval_count if end is not None else num_prompt_tokens) or 0
    n_out = end.eval_count if end is not None else 0
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}  # fmt: skip


class ResponseEvents:
    """An answer's pieces as the Responses stream events, and the response they make: tracks the
    item that is open (its index and kind) and closes it when the next kind of content arrives.
    `shell`: the response object's request-side fields (model, instructions, tools, ...)."""

    def __init__(self, shell: dict[str, Any], num_prompt_tokens: int | None) -> None:
        self.response: dict[str, Any] = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "output": [], "usage": None, **shell,
        }  # fmt: skip
        self.num_prompt_tokens = num_prompt_tokens
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""  # the open item's text (reasoning or output_text)
        self._call_index = -1  # the open function_call item's call (its deltas' index)

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def event(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        out = {"type": kind, **payload, "sequence_number": self.seq}
        self.seq += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", {"response": self._snapshot()}),
                self.event("response.in_progress", {"response": self._snapshot()})]  # fmt: skip

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if piece.thinking:
            out += self._item("reasoning", {"summary": [], "content": []}, "reasoning_text")
            out.append(self._delta("response.reasoning_text.delta", piece.thinking))
        if piece.content:
            out += self._item(
                "message", {"role": "assistant", "status": "in_progress", "content": []}, "output_text"
            )
            out.append(self._delta("response.output_text.delta", piece.content, logprobs=[]))
        for d in piece.call_deltas:
            if d.id is not None:  # a call opens: its own function_call item
                out += self._close()
                self.open = {"id": new_id("fc"), "type": "function_call", "call_id": new_id("call"),
                             "name": d.name, "arguments": "", "status": "in_progress"}  # fmt: skip
                self._call_index = d.index
                self.output.append(self.open)
                out.append(self.event("response.output_item.added", {
                    "output_index": len(self.output) - 1, "item": dict(self.open)}))  # fmt: skip
            call = self.open
            if (
                d.arguments
                and call is not None
                and call["type"] == "function_call"
                and self._call_index == d.index
            ):
                call["arguments"] += d.arguments
                out.append(self.event("response.function_call_arguments.delta", {
                    "item_id": call["id"], "output_index": len(self.output) - 1, "delta": d.arguments}))  # fmt: skip
        if piece.end is not None:
            out += self._finish(piece.end)
        return out

    def _finish(self, end: End) -> list[dict[str, Any]]:
        """Close the open item; the response completed, or incomplete when max_output_tokens cut
        an answer that made no call (a whole call before the cut counts as done, as chat's
        finish_reason "tool_calls" does)."""
        calls = any(item["type"] == "function_call" for item in self.output)
        cut = (end.reason == "length" and not calls) or end.call_cut  # call_cut: a call sent in part
        out = self._close("incomplete" if cut else "completed")
        self.response["status"] = "incomplete" if cut else "completed"
        self.response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
        self.response["usage"] = usage(end, self.num_prompt_tokens)
        kind = "response.incomplete" if cut else "response.completed"
        return [*out, self.event(kind, {"response": self._snapshot()})]

    def error(self, error: APIError) -> list[dict[str, Any]]:
        """An error after the stream began: `error`, then `response.failed`."""
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        self.response.update(status="failed", error={"code": code, "message": error.message})
        return [self.event("error", {"code": error.code or code, "message": error.message, "param": error.param}),
                self.event("response.failed", {"response": self._snapshot()})]  # fmt: skip

    def _snapshot(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.response))  # the state now, not a view that changes later

    def _item(self, kind: str, fields: dict[str, Any], part: str) -> list[dict[str, Any]]:
        """Open an item of `kind` with its one content part, unless one is open already."""
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        prefix = {"reasoning": "rs", "message": "msg"}[kind]
        self.open, self.text = {"id": new_id(prefix), "type": kind, **fields}, ""
        self.output.append(self.open)
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1}
        out.append(self.event("response.output_item.added", {"output_index": where["output_index"],
                                                             "item": json.loads(json.dumps(self.open))}))  # fmt: skip
        out.append(
            self.event(
                "response.content_part.added", {**where, "content_index": 0, "part": self._part(part, "")}
            )
        )
        return out

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "output_text":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": kind, "text": text}

    def _delta(self, kind: str, delta: str, **extra: Any) -> dict[str, Any]:
        assert self.open is not None
        self.text += delta
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return self.event(kind, {**where, "delta": delta, **extra})

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's done events: its text, its part, the item (now holding the part)."""
        if self.open is None:
            return []
        item, self.open = self.open, None
        if item["type"] == "function_call":
            item["status"] = status
            where = {"item_id": item["id"], "output_index": self.output.index(item)}
            return [self.event("response.function_call_arguments.done",
                               {**where, "arguments": item["arguments"], "name": item["name"]}),
                    self.event("response.output_item.done", {"output_index": where["output_index"], "item": item})]  # fmt: skip
        is_text = item["type"] == "message"
        part = self._part("output_text" if is_text else "reasoning_text", self.text)
        item["content"] = [part]
        if is_text:
            item["status"] = status
        where = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        done = {"text": self.text, "logprobs": []} if is_text else {"text": self.text}
        return [
            self.event(
                "response.output_text.done" if is_text else "response.reasoning_text.done", {**where, **done}
            ),
            self.event("response.content_part.done", {**where, "part": part}),
            self.event("response.output_item.done", {"output_index": where["output_index"], "item": item}),
        ]


def sse(event: dict[str, Any]) -> str:
    """One server-sent event: its type on the `event:` line and in the data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
