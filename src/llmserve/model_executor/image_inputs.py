"""A request's images on the runner's side: encoded when a prefill chunk first reaches their tokens,
kept until the chunk that computes their last token, and sliced into each chunk's rows.

    prompt positions:   ... [offset ........ image ........ end) ...
    chunk [start, end):        [start ....... end)                   rows offset - start .. (clipped)

A chunk usually takes an image whole (the scheduler never ends a fresh chunk inside one); after a
prefix-cache hit it may start inside one, and then takes the image's remaining rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
        with tokens in it, and those images' spans (for their both-ways attention)."""
        rows: list[tuple[int, torch.Tensor]] = []
        spans: list[tuple[int, int]] = []
        for j, m in enumerate(self.inputs):
            if not (m.offset < end and start < m.end):
                continue
            vectors = self.encoded.get(j)
            if vectors is None:
                pixels = m.data.to(next(model.parameters()).device)  # type: ignore[attr-defined]
                vectors = model.embed_images(pixels[None])[0]  # type: ignore[operator]
                self.encoded[j] = vectors
            lo, hi = max(start, m.offset), min(end, m.end)
            rows.append((lo - start, vectors[lo - m.offset : hi - m.offset]))
            spans.append((m.offset, m.end))
            if hi == m.end:
                del self.encoded[j]  # its last token runs now: no later chunk needs it
        return tuple(rows), tuple(spans)
