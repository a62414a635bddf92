"""A request's images on the runner's side: encoded when a prefill chunk first reaches their tokens,
kept until the chunk that computes their last token, and sliced into each chunk's rows.

    prompt positions:   ... [offset ........ image ........ end) ...
    chunk [start, end):        [start ....... end)                   rows offset - start .. (clipped)

A chunk usually takes a both-ways image whole (the scheduler never ends a fresh chunk inside one);
after a prefix-cache hit it may start inside one, and then takes the image's remaining rows. A
causally attended image (Qwen2.5-VL) may be split anywhere: its vectors wait for the next chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.core.multimodal import MultiModalInput


@dataclass(slots=True)
class RequestImages:
    """One request's images and the vectors of those being computed."""

    inputs: Sequence[MultiModalInput]
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Image index -> its vectors [length, hidden], until its last token is computed."""

    def chunk_rows(
        self, model: torch.nn.Module, start: int, end: int
    ) -> tuple[tuple[tuple[int, torch.Tensor], ...], tuple[tuple[int, int], ...]]:
        """For the chunk of positions [start, end): (first row in the chunk, vectors) of each image
        with tokens in it, and the spans of those attended both ways."""
        rows: list[tuple[int, torch.Tensor]] = []
        spans: list[tuple[int, int]] = []
        for j, m in enumerate(self.inputs):
            if not (m.offset < end and start < m.end):
                continue
            vectors = self.encoded.get(j)
            if vectors is None:
                vectors = model.encode_image(m.data)  # type: ignore[operator]
                self.encoded[j] = vectors
            lo, hi = max(start, m.offset), min(end, m.end)
            rows.append((lo - start, vectors[lo - m.offset : hi - m.offset]))
            if m.bidirectional:
                spans.append((m.offset, m.end))
            if hi == m.end:
                del self.encoded[j]  # its last token runs now: no later chunk needs it
        return tuple(rows), tuple(spans)


@dataclass(frozen=True, slots=True)
class RopePositions:
    """A request's M-RoPE positions (layers/mrope.py): its prompt's, then every later token's
    sequence index + `delta` on all three axes. Made from the prompt and its images alone, so a
    recomputed prompt and a prefix-cache hit take the same positions."""

    prompt: np.ndarray  # [3, num_prompt_tokens]
    delta: int

    @classmethod
    def of(cls, model: torch.nn.Module, prompt_len: int, inputs: Sequence[MultiModalInput]) -> RopePositions:
        return cls(*model.rope_positions(prompt_len, inputs))  # type: ignore[operator]

    def slice(self, start: int, end: int) -> np.ndarray:  # [3, end - start] for positions [start, end)
        P = self.prompt.shape[1]
        later = np.arange(max(start, P), end, dtype=np.int64) + self.delta
        if start >= P:
            return np.broadcast_to(later, (3, later.size))
        head = self.prompt[:, start : min(end, P)]
        return head if end <= P else np.concatenate([head, np.broadcast_to(later, (3, later.size))], axis=1)
