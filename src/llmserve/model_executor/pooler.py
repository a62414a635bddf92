"""Pooling for embedding requests: per-request accumulators fed chunk by chunk, and the model's
own pooling choice read from its sentence-transformers files.

A prompt may run over several steps (chunked prefill), so each request keeps what its pooling
needs of the chunks seen so far, on the device, in float32:

    last   nothing until the chunk that holds the last prompt token, then that token's row
    mean   a running sum of rows and their count
    cls    the first token's row (the chunk that starts at position 0)

When the last chunk has run, `finish` turns the accumulators of every request that ended in the
step into vectors together (cut to `dimensions`, then L2-normalised) and copies them to the host
in one transfer: one extra device->host sync, only in steps where an embedding request ends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.pooling_params import PoolingParams, PoolingType

logger = logging.getLogger("llmserve")


@dataclass(slots=True)
class PoolingState:
    """One embedding request's accumulator (reset with the request when it is preempted)."""

    params: PoolingParams
    num_prompt_tokens: int
    value: torch.Tensor | None = None  # [hidden] float32: the sum (mean) or the chosen row
    count: int = 0

    def add_chunk(self, hidden: torch.Tensor, start: int) -> None:
        """`hidden` [n, H]: the final-norm states of prompt positions [start, start + n)."""
        n = hidden.shape[0]
        pooling = self.params.pooling
        if pooling == "mean":
            chunk = hidden.float().sum(dim=0)  # [H]
            self.value = chunk if self.value is None else self.value + chunk
            self.count += n
        # a copy, never a view: the row outlives this step, and the runner may reuse its output
        # buffers (a CUDA graph's static output; `.float()` of a float32 row would be a view)
        elif pooling == "cls" and start == 0:
            self.value = hidden[0].to(torch.float32, copy=True)
        elif pooling == "last" and start + n == self.num_prompt_tokens:
            self.value = hidden[n - 1].to(torch.float32, copy=True)

    def vector(self) -> torch.Tensor:
        """The pooled [H] vector, before cutting and normalising."""
        assert self.value is not None, "pooled before the request's prompt was computed"
        return self.value / self.count if self.params.pooling == "mean" else self.value


def finish(
    states: list[PoolingState], score_head: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[list[float]]:
    """The finished requests' vectors: pooled, cut to `dimensions`, normalised; one host copy.
    `score_head`: a cross-encoder's head ([B, H] pooled rows -> [B, labels] scores), applied to
    the pooled rows together before they are cut or normalised."""
    pooled = [state.vector() for state in states]
    if score_head is not None:
        pooled = list(score_head(torch.stack(pooled)).float().unbind(0))
    rows: list[torch.Tensor] = []
    for state, v in zip(states, pooled, strict=True):
        if state.params.dimensions is not None:
            v = v[: state.params.dimensions]
        if state.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        rows.append(v)
    sizes = [r.shape[0] for r in rows]
    flat = torch.cat(rows).cpu().tolist()  # the one device->host sync
    out, offset = [], 0
    for size in sizes:
        out.append(flat[offset : offset + size])
        offset += size
    return out


# sentence-transformers' Pooling config keys, in the order they are tried
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)


def model_pooling(folder: Path | None) -> tuple[PoolingType, bool] | None:
    """(pooling, normalize) from a sentence-transformers model folder (`modules.json` naming a
    `Pooling` module whose `config.json` picks the mode, and a `Normalize` module or not); None
    when the folder has no such files (or a mode llmserve does not implement: max, weighted mean)."""
    if folder is None or not (folder / "modules.json").is_file():
        return None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling_dir = next(m["path"] for m in modules if m.get("type", "").endswith(".Pooling"))
        config = json.loads((folder / pooling_dir / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError) as e:
        logger.warning("ignoring %s/modules.json: no readable Pooling module (%s)", folder, e)
        return None
    mode = next((name for key, name in _ST_MODES if config.get(key)), None)
    if mode is None:
        logger.warning("the model's pooling (%s) is not implemented; using last-token pooling", config)
        return None
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    return mode, normalize


def default_pooling_params(
    pooling: str, normalize: bool | None, folder: Path | None, gguf_pooling: str | None = None
) -> PoolingParams:
    """The engine's pooling for embedding requests (`ModelConfig.pooling` and
    `normalize_embeddings`): the user's choice, else the model's sentence-transformers config (or
    a GGUF file's `pooling_type`, normalised as llama-server's embeddings are), else last-token
    pooling, normalised (vLLM's defaults for a decoder LM run as an embedder)."""
    own = model_pooling(folder) or ((gguf_pooling, True) if gguf_pooling in ("last", "mean", "cls") else None)
    if pooling == "auto":
        pooling = own[0] if own is not None else "last"
    if normalize is None:
        normalize = own[1] if own is not None else True
    return PoolingParams(pooling, normalize)  # type: ignore[arg-type]
