"""Reasoning models' thinking split from their answer: `<think> … </think>` (Qwen3, DeepSeek-R1,
SmolLM3, QwQ) becomes the message's `reasoning_content`, the rest its `content`, as vLLM's
reasoning parsers return them.

    <think>The user wants… </think>Paris.   ->  reasoning_content "The user wants…", content "Paris."

A template that opens `<think>` itself in the generation prompt (DeepSeek-R1) leaves the model's
text with only the closing tag: when the prompt ends inside `<think>`, everything before
`</think>` is reasoning. Output cut short
inside the thinking is all reasoning, with no content. `--reasoning-parser auto` turns this on for
templates that mention `<think>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmserve.server.serving.tools import partial_suffix

if TYPE_CHECKING:
    from llmserve.tokenizer.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"


def uses_think_tags(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template  # type: ignore[operator]


def prompt_opens_thinking(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> bool:
    """Whether the rendered prompt ends inside `<think>` (the template opened the thinking), read
    off its last few tokens."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole reply; (None, text) when it has no thinking.
    `opened`: the prompt already ends inside `<think>` (the template opened it)."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(OPEN):
        return None, text
    body = stripped if opened else stripped[len(OPEN) :]
    end = body.find(CLOSE)
    if end < 0:  # cut short while thinking
        return body.strip() or None, None
    return body[:end].strip() or None, body[end + len(CLOSE) :].lstrip() or None


class ReasoningStreamSplitter:
    """Routes a streamed reply's text to `reasoning_content` until `</think>`, then to `content`.
    Text that may be the start of a tag is held back until the next piece decides it."""

    def __init__(self, opened: bool = False) -> None:
        self._held = ""
        self._state = "thinking" if opened else "start"  # start -> thinking -> answer, or start -> answer

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) safe to send now."""
        buf, self._held = self._held + text, ""
        if self._state == "start":
            lead = buf.lstrip()
            if lead.startswith(OPEN):
                self._state, buf = "thinking", lead[len(OPEN) :]
            elif OPEN.startswith(lead):  # empty, whitespace or a piece of the tag: undecided
                self._held = buf
                return "", ""
            else:
                self._state = "answer"
        if self._state == "answer":
            return "", buf
        end = buf.find(CLOSE)
        if end < 0:
            keep = partial_suffix(buf, CLOSE)
            self._held = buf[len(buf) - keep :]
            return buf[: len(buf) - keep], ""
        self._state = "answer"
        return buf[:end], buf[end + len(CLOSE) :].lstrip()

    def finish(self) -> tuple[str, str]:
        """What is still held back: reasoning inside unfinished thinking, content otherwise."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held)
