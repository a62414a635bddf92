"""A request's images as the scheduler and the KV-cache manager see them: where each image's tokens
sit in the prompt and what identifies the image; the pixels travel along as opaque data.

    prompt:  ... <boi> [img img img ... img] <eoi> ...
                       ^offset               offset + length   (length = the model's tokens per image)

Two rules follow from the image tokens' K/V depending on the image, not on their (placeholder) ids:

  * prefix caching: a block that holds any of an image's tokens is identified by the image's hash
    too (`block_extra_keys`), so the same placeholder ids with another image never hit;
  * chunked prefill: where an image's tokens attend to each other both ways (Gemma 3), a fresh
    prefill chunk never ends inside the image (`cut_chunk`): it stops before the image, or takes
    the rest of it whole. A chunk may *start* inside one: only after a prefix-cache hit, whose
    cached K/V were computed with the whole image in view, so the rest of it computes exactly as
    one chunk would. Such an image longer than the step's token budget is refused at input
    processing. Images attended causally, as text (Qwen2.5-VL: `bidirectional` False), split
    anywhere.

Torch-free (the `core/` rule): `data` is whatever the model runner needs to encode the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One image of a prompt."""

    offset: int
    """Prompt position of its first placeholder token."""
    length: int
    """Its number of placeholder tokens (the embeddings the encoder makes of it)."""
    identifier: str
    """A hash of its content (hex sha256 of the processed pixels): part of the blocks' identity."""
    data: object = None
    """What the model runner encodes (a pixel tensor); opaque here."""
    bidirectional: bool = True
    """Whether its tokens attend to each other both ways (else causally, as text)."""

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra_keys(mm_inputs: Sequence[MultiModalInput], start: int, end: int) -> tuple:
    """The identities of the images with tokens in positions [start, end), for a block's hash."""
    return tuple(("image", m.identifier) for m in mm_inputs if m.offset < end and start < m.end)


def cut_chunk(mm_inputs: Sequence[MultiModalInput], start: int, num_new: int) -> int:
    """`num_new` cut so that the chunk [start, start + num_new) does not end inside an image: up to
    the first image it would split, or 0 when that image began at or before `start` (the chunk
    must then take the rest of it whole, which the budget did not allow)."""
    end = start + num_new
    for m in mm_inputs:  # in prompt order
        if m.bidirectional and m.offset < end < m.end and start < m.end:
            return max(0, m.offset - start)
    return num_new
