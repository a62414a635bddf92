"""A prompt's images and videos at input processing: whether the model takes them, their
placeholders expanded in the text (the media preprocessed by the model's prompt processor,
multimodal/), and, once the text is tokenized, their `MultiModalInput`s in prompt order. Refusals
are `ParameterError`s naming `images` or `videos`; nothing here touches the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.core.multimodal import MultiModalInput
from llmserve.errors import ParameterError
from llmserve.multimodal.processor import PromptProcessor

PlaceMedia = Callable[[list[int]], tuple[MultiModalInput, ...]]
"""A prompt's token ids -> its media's inputs (ParameterError where the placeholders disagree)."""


@dataclass(frozen=True, slots=True)
class MediaInputs:
    processor: PromptProcessor | None
    """The model's prompt processor (None: the model takes no images)."""
    model_name: str
    bidirectional_images: bool
    """Whether the runner attends an image's tokens both ways (the model and its backend)."""
    attention_backend: str
    token_budget: int
    """max_num_batched_tokens: an image attended both ways runs in one chunk."""

    @property
    def takes_videos(self) -> bool:
        return hasattr(self.processor, "expand_videos")  # Qwen2-VL / Qwen2.5-VL's

    def expand(
        self, prompt: str | Sequence[int], images: Sequence[Any], videos: Sequence[Any]
    ) -> tuple[str | Sequence[int], PlaceMedia]:
        """The prompt with each image's and video's placeholder expanded, and how to place them in
        its token ids; without media, the check that it types no placeholder."""
        if not images and not videos:
            return prompt, self._no_media
        processor = self._check_videos() if videos else self._check_images(images)
        if not isinstance(prompt, str):
            raise ParameterError("a prompt with images or videos must be text", param="prompt")
        prepared: list[Any] = []
        if images:
            prompt, prepared = processor.expand(prompt, images)
        if not videos:
            return prompt, lambda ids: processor.inputs(ids, prepared)
        prompt, prepared_videos = processor.expand_videos(prompt, videos)  # type: ignore[attr-defined]
        return prompt, lambda ids: processor.media_inputs(ids, prepared, prepared_videos)  # type: ignore[attr-defined]

    def _no_media(self, token_ids: list[int]) -> tuple[MultiModalInput, ...]:
        if self.processor is not None:
            self.processor.check_no_placeholders(token_ids)
        return ()

    def _check_images(self, images: Sequence[Any]) -> PromptProcessor:
        """The processor for a prompt with `images`, or a ParameterError saying why there is none."""
        if self.processor is None:
            raise ParameterError(f"model {self.model_name} takes no images (text only)", param="images")
        if not self.processor.both_ways:
            return self.processor  # attended causally: any backend, chunks split images anywhere
        if not self.bidirectional_images:
            raise ParameterError(
                f"images need an attention backend that attends an image's tokens both ways (torch, "
                f"cpu, triton); this engine runs {self.attention_backend!r}",
                param="images",
            )
        n = self.processor.tokens_per_image  # type: ignore[attr-defined]  # both ways: Gemma 3's fixed count
        if n > self.token_budget:  # an image's tokens run in one chunk (core/multimodal.py)
            raise ParameterError(
                f"an image is {n} tokens, more than the step's token budget ({self.token_budget}, "
                f"max_num_batched_tokens)",
                param="images",
            )
        return self.processor

    def _check_videos(self) -> PromptProcessor:
        """The processor for a prompt with videos, or a ParameterError saying why there is none."""
        if self.processor is None or not self.takes_videos:
            raise ParameterError(
                f"model {self.model_name} takes no videos (Qwen2-VL and Qwen2.5-VL do)", param="videos"
            )
        return self.processor
