"""Embeddings: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed` (and its legacy
`POST /api/embeddings`), over one engine path.

Each input is an embedding request of the engine (engine/llm_engine.py
`process_embedding_inputs`): its prompt runs through the same scheduler as generation requests
(prefill chunks inside each step's token budget), is pooled as the engine's `--pooling` says, and
finishes when its prefill does. Every input of an API request is queued at once, or none (429).

    OpenAI   input: a string, strings, token ids or lists of them; encoding_format float | base64
             (little-endian float32, what the `openai` client decodes); dimensions (Matryoshka
             truncation, re-normalised when the engine normalises); usage counts prompt tokens
    Ollama   input: a string or strings; truncate (default true: inputs longer than the context
             keep their first tokens; false: a 400); dimensions; keep_alive as on /api/generate
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.requests import Request

from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.server.errors import APIError
from llmserve.server.protocol import EmbeddingRequest, parse
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.inputs import start_requests
from llmserve.server.serving.ollama import Lenient, _keep_alive
from llmserve.server.serving.streaming import engine_error, merged, run_unless_disconnected


class OllamaEmbedRequest(Lenient):
    model: StrictStr
    input: StrictStr | list[StrictStr] = ""
    truncate: StrictBool = True
    dimensions: StrictInt | None = None
    options: dict[str, Any] | None = None
    """Sampling options: nothing to sample, ignored (as Ollama ignores most of them here)."""
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None


class OllamaLegacyEmbedRequest(Lenient):
    model: StrictStr
    prompt: StrictStr = ""
    options: dict[str, Any] | None = None
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None


async def embed(
    ctx: ServingContext,
    raw: Request,
    inputs: Sequence[str | list[int]],
    dimensions: int | None,
    truncate: bool,
) -> tuple[list[ProcessedPrompt], list[list[float]]]:
    """Every input's embedding, in order (400 naming the input that cannot be embedded)."""
    cfg, engine = ctx.config, ctx.engine.engine
    if engine.is_classifier:  # a cross-encoder or classifier: its pooled output is no embedding
        raise APIError(400, engine.embedding_only_message("embeddings"), param="model")
    if len(inputs) > cfg.max_prompts:
        raise APIError(
            400, f"input has {len(inputs)} entries; at most {cfg.max_prompts} are allowed", param="input"
        )
    try:
        pooling = dataclasses.replace(engine.default_pooling, dimensions=dimensions)
        pooling.validate_for_model(engine.hidden_size)
    except ValueError as e:
        raise APIError(400, str(e), param="dimensions") from None

    def process(i: int, x: str | list[int]) -> ProcessedPrompt:
        if truncate:  # Ollama's default: keep the first tokens that fit the context
            ids = engine.tokenizer.encode(x) if isinstance(x, str) else x
            x = ids[: engine.max_model_len]
            if isinstance(x, list) and len(ids) > len(x) and engine.tokenizer.wraps_cls_sep:
                x[-1] = ids[-1]  # an encoder's text ends with [SEP], kept as sentence-transformers keeps it
        try:
            return engine.process_embedding_inputs(x, pooling)
        except ValueError as e:
            where = f"input[{i}]" if len(inputs) > 1 else "input"
            raise APIError(400, f"{where}: {e}", param="input") from None

    processed = await asyncio.to_thread(lambda: [process(i, x) for i, x in enumerate(inputs)])
    return processed, await run_pooled(ctx, raw, processed, "embd")


async def run_pooled(
    ctx: ServingContext, raw: Request, processed: list[ProcessedPrompt], prefix: str
) -> list[list[float]]:
    """Queue checked pooling inputs (embeddings, a cross-encoder's pairs) as one API request's,
    all or none, and return their vectors in order; a client gone first aborts them."""
    streams = start_requests(ctx, processed, 0, prefix)

    async def collect() -> list[list[float]]:
        vectors: list[list[float] | None] = [None] * len(streams)
        try:
            async for i, out in merged(ctx, streams):
                if out.finished:
                    vectors[i] = out.embedding
        except APIError:
            raise
        except Exception as e:
            raise engine_error(e) from None
        assert all(v is not None for v in vectors), "a pooling request finished without its vector"
        return vectors  # type: ignore[return-value]

    return await run_unless_disconnected(raw, collect, streams)


def _openai_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    x = req.input
    if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)):
        return [x]  # type: ignore[list-item]
    if not x:
        raise APIError(400, "input must not be empty", param="input")
    return list(x)  # type: ignore[arg-type]


def encode_vector(vector: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embeddings(ctx: ServingContext, req: EmbeddingRequest, raw: Request) -> JSONResponse:
    """`POST /v1/embeddings` on a native model."""
    if req.dimensions is not None and req.dimensions < 1:
        raise APIError(400, f"dimensions must be >= 1; got {req.dimensions}", param="dimensions")
    processed, vectors = await embed(ctx, raw, _openai_inputs(req), req.dimensions, truncate=False)
    encode = encode_vector if req.encoding_format == "base64" else list
    num_tokens = sum(len(p.token_ids) for p in processed)
    return JSONResponse({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
        "model": ctx.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    })  # fmt: skip


async def ollama_embed(ctx: ServingContext, req: OllamaEmbedRequest, raw: Request) -> dict[str, Any]:
    """`POST /api/embed`: no input only loads the model (Ollama's answer: no embeddings)."""
    start = time.monotonic()
    inputs = [req.input] if isinstance(req.input, str) and req.input else list(req.input or [])
    processed, vectors = await embed(ctx, raw, inputs, req.dimensions, req.truncate) if inputs else ([], [])
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": int(1e9 * (time.monotonic() - start)),
        "load_duration": 0,
        "prompt_eval_count": sum(len(p.token_ids) for p in processed),
    }


async def ollama_legacy_embeddings(ctx: ServingContext, req: OllamaLegacyEmbedRequest, raw: Request) -> Any:
    """`POST /api/embeddings` (Ollama's older route): one `prompt` -> `embedding`."""
    if not req.prompt:
        return {"embedding": []}
    _, vectors = await embed(ctx, raw, [req.prompt], None, truncate=True)
    return {"embedding": vectors[0]}


async def parse_ollama(raw: Request, model: type[Lenient]) -> Any:
    """An Ollama embedding request (400 on a bad field) and its keep_alive, checked."""
    req = parse(model, await raw.json())
    return req, _keep_alive(req)
