"""Anthropic's response shapes, from an answer's pieces (serving/pieces.py): the whole `message`,
or its stream of server-sent events.

A message's content is a list of blocks, in the order the model wrote them: `thinking` (the
`<think>` part), `text`, then one `tool_use` block per call. Streamed, each block opens, takes its
deltas and closes before the next one opens:

    event: message_start         {"message": {... "content": [], "usage": {"input_tokens": N}}}
    event: ping
    event: content_block_start   {"index": 0, "content_block": {"type": "thinking", ...}}
    event: content_block_delta   {"index": 0, "delta": {"type": "thinking_delta", "thinking": "..."}}
    event: content_block_stop    {"index": 0}
    event: content_block_start   {"index": 1, "content_block": {"type": "text", "text": ""}}
    event: content_block_delta   {"index": 1, "delta": {"type": "text_delta", "text": "..."}}    (many)
    event: content_block_stop    {"index": 1}
    event: content_block_start   {"index": 2, "content_block": {"type": "tool_use", "id", "name", "input": {}}}
    event: content_block_delta   {"index": 2, "delta": {"type": "input_json_delta", "partial_json": "..."}}
    event: content_block_stop    {"index": 2}
    event: message_delta         {"delta": {"stop_reason", "stop_sequence"}, "usage": {"output_tokens": M}}
    event: message_stop

A tool call's block opens as soon as the model has written the call's name, and its input
streams as `input_json_delta`s while the model writes it (the pieces' call deltas,
tool_stream.py: they join to the JSON of the whole message's `input`); a call that cannot stream
comes whole when the answer ends, as one delta. A call that max_tokens cuts after its block
opened ends the message with `max_tokens`. Thinking blocks carry an empty `signature`: the
thinking is the model's own text, and there is nothing to verify when it comes back.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from llmserve.server.serving.pieces import End, Piece
from llmserve.server.serving.tools import ToolCall


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A parsed call as a `tool_use` block (arguments that are not a JSON object: an empty input)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    arguments = arguments if isinstance(arguments, dict) else {}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": arguments}


def stop_reason(end: End | None, has_calls: bool, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): `tool_use` when the answer called tools (also when max_tokens
    cut it after a whole call, as /v1/chat/completions reports `tool_calls`), `max_tokens`, and
    `stop_sequence` with the string when one of the request's stop_sequences ended it; else
    `end_turn` (the model's end-of-turn token)."""
    reason = end.reason if end is not None else None
    if end is not None and end.call_cut:  # a call streamed in part, then cut
        return "max_tokens", None
    if (has_calls and reason in ("stop", "length")) or reason == "tool_calls":  # tool_calls: from a remote
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = end.stop_reason if end is not None else None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(end: End | None, num_prompt_tokens: int | None) -> dict[str, int]:
    input_tokens = end.prompt_eval_count if end is not None else num_prompt_tokens
    return {"input_tokens": input_tokens or 0, "output_tokens": end.eval_count if end is not None else 0}


def message(message_id: str, model: str, answer: Piece, stop_sequences: list[str]) -> dict[str, Any]:
    """The whole answer as Anthropic's `message` object."""
    content: list[dict[str, Any]] = []
    if answer.thinking:
        content.append({"type": "thinking", "thinking": answer.thinking, "signature": ""})
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    content += [tool_use_block(call) for call in answer.tool_calls]
    reason, sequence = stop_reason(answer.end, bool(answer.tool_calls), stop_sequences)
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(answer.end, None),
    }  # fmt: skip


def event(kind: str, payload: dict[str, Any]) -> str:
    """One server-sent event: its type on the `event:` line and in the data."""
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class MessageEvents:
    """An answer's pieces as Anthropic's stream events: tracks the block that is open (its index
    and type) and closes it when the next kind of content arrives."""

    def __init__(
        self, message_id: str, model: str, stop_sequences: list[str], num_prompt_tokens: int | None
    ) -> None:
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.num_prompt_tokens = num_prompt_tokens
        self.index = -1
        self.open: str | None = None  # the type of the block that is open
        self.has_calls = False
        self._call_blocks: dict[int, int] = {}  # a call's delta index -> its block's index

    def opening(self) -> list[str]:
        """message_start (content empty, the prompt's size as input_tokens), then a ping."""
        start = {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(None, self.num_prompt_tokens),
        }  # fmt: skip
        return [event("message_start", {"message": start}), event("ping", {})]

    def piece(self, piece: Piece) -> list[str]:
        out: list[str] = []
        if piece.thinking:
            out += self._block({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": piece.thinking}))
        if piece.content:
            out += self._block({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": piece.content}))
        for d in piece.call_deltas:
            if d.id is not None:  # a call opens: its own tool_use block
                block = {
                    "type": "tool_use",
                    "id": f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": d.name,
                    "input": {},
                }
                out += self._block(block, always_new=True)
                self._call_blocks[d.index] = self.index
            if d.arguments and self.open == "tool_use" and self._call_blocks.get(d.index) == self.index:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        self.has_calls = self.has_calls or bool(piece.tool_calls)
        if piece.end is not None:
            out += self._close()
            reason, sequence = stop_reason(piece.end, self.has_calls, self.stop_sequences)
            out.append(event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": _usage(piece.end, self.num_prompt_tokens),
            }))  # fmt: skip
            out.append(event("message_stop", {}))
        return out

    def _block(self, block: dict[str, Any], always_new: bool = False) -> list[str]:
        """Open a block of `block`'s type unless one is open already (each tool_use is its own)."""
        if self.open == block["type"] and not always_new:
            return []
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]
