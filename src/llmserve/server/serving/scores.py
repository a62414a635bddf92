"""Scores of text pairs over HTTP: vLLM's `POST /v1/score` and the rerank API that vLLM,
llama-server, Jina and Cohere share (`POST /v1/rerank`, also at `/rerank` and `/v2/rerank`); and
vLLM's `POST /classify` (also `/v1/classify`), a sequence classifier's labels for texts, and vLLM's
`POST /pooling`, any pooling model's own output (an embedding, or its classifier head's).

    score    text_1: a string or strings, text_2: a string or strings; one text_1 meets every
             text_2, or the two lists pair side by side -> data[i].score per pair, in order
    rerank   query and documents (strings, or Jina's {"text": ...} objects), top_n (0 or none:
             all), return_documents (default true) -> results, most relevant first, each with its
             document's index and relevance_score

Both run on the engine's pooling path (engine/scoring.py): a cross-encoder (reranker) reads each
pair as one input and its head gives the score; any other model embeds each distinct text once
and a pair scores the cosine similarity of its two embeddings. Every input of an API request is
queued at once, or none (429); a text too long for the context is a 400 naming it, unless
`truncate_prompt_tokens` (vLLM's; -1: the context) cuts it (a pair loses tokens from its longer
text first, as sentence-transformers truncates). usage counts the tokens the model read.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictInt, StrictStr
from starlette.requests import Request

from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.engine.scoring import classify_input, pair_texts, plan_scores
from llmserve.server.errors import APIError
from llmserve.server.protocol import TokenIds, _Request
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.embeddings import embed, encode_vector, run_pooled


class ScoreRequest(_Request):
    """`POST /v1/score` (vLLM's)."""

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: StrictInt | None = None
    """vLLM's: inputs keep at most this many tokens (-1: the context); none: too long is a 400."""
    user: StrictStr | None = None


class ClassifyRequest(_Request):
    """`POST /classify` (vLLM's): one input or several, as text or token ids."""

    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    truncate_prompt_tokens: StrictInt | None = None
    user: StrictStr | None = None


class RerankDocument(_Request):
    text: StrictStr


class RerankRequest(_Request):
    """`POST /v1/rerank` (vLLM's, after Jina's and Cohere's)."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = None
    """How many results to return, most relevant first; 0 or none: all."""
    return_documents: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = None
    user: StrictStr | None = None


async def score_pairs(
    ctx: ServingContext,
    raw: Request,
    pairs: list[tuple[str, str]],
    names: tuple[str, str],
    truncate: int | None,
) -> tuple[list[float], int]:
    """Each pair's score, in order, and the prompt tokens read; `names`: the request's fields for
    a pair's first and second text, which an error names; `truncate`: truncate_prompt_tokens."""
    if len(pairs) > ctx.config.max_prompts:
        raise APIError(
            400, f"{len(pairs)} pairs to score; at most {ctx.config.max_prompts} are allowed", param=names[1]
        )
    try:
        plan = await asyncio.to_thread(plan_scores, ctx.engine.engine, pairs, truncate, names)
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    vectors = await run_pooled(ctx, raw, plan.inputs, "score")
    return plan.scores(vectors), plan.num_tokens


async def create_score(ctx: ServingContext, req: ScoreRequest, raw: Request) -> JSONResponse:
    """`POST /v1/score` on a native model."""
    try:
        pairs = pair_texts(req.text_1, req.text_2)
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    scores, num_tokens = await score_pairs(ctx, raw, pairs, ("text_1", "text_2"), req.truncate_prompt_tokens)
    return JSONResponse({
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
    })  # fmt: skip


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw: Request) -> JSONResponse:
    """`POST /v1/rerank` on a native model."""
    if not req.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, f"top_n must be >= 0 (0: all documents); got {req.top_n}", param="top_n")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    pairs = [(req.query, d) for d in docs]
    scores, num_tokens = await score_pairs(
        ctx, raw, pairs, ("query", "documents"), req.truncate_prompt_tokens
    )
    order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return JSONResponse({
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": ctx.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    })  # fmt: skip


async def classify_outputs(
    ctx: ServingContext, raw: Request, req: ClassifyRequest
) -> tuple[list[ProcessedPrompt], list[list[float]]]:
    """A sequence classifier's inputs (`req.input`, checked: a 400 naming the bad one) and each
    one's outputs (its head's: label probabilities, or a cross-encoder's score), in order."""
    engine = ctx.engine.engine
    x = req.input
    inputs = [x] if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)) else list(x)
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    if len(inputs) > ctx.config.max_prompts:
        raise APIError(
            400, f"input has {len(inputs)} entries; at most {ctx.config.max_prompts} are allowed", "input"
        )

    def process() -> list[ProcessedPrompt]:
        out = []
        for i, item in enumerate(inputs):
            try:
                out.append(classify_input(engine, item, req.truncate_prompt_tokens))  # type: ignore[arg-type]
            except ValueError as e:
                own = getattr(e, "param", None)
                where = f"input[{i}]" if len(inputs) > 1 else "input"
                param = own if own in ("model", "truncate_prompt_tokens") else "input"
                raise APIError(400, f"{where}: {e}", param=param) from None
        return out

    processed = await asyncio.to_thread(process)
    return processed, await run_pooled(ctx, raw, processed, "classify")


async def create_classification(ctx: ServingContext, req: ClassifyRequest, raw: Request) -> JSONResponse:
    """`POST /classify` on a native model: each input's label probabilities and its label."""
    processed, vectors = await classify_outputs(ctx, raw, req)
    labels = ctx.engine.engine.classifier_labels
    num_tokens = sum(len(p.token_ids) for p in processed)
    data = [{"index": i, "label": labels[max(range(len(v)), key=v.__getitem__)], "probs": v, "num_classes": len(v)}
            for i, v in enumerate(vectors)]  # fmt: skip
    return JSONResponse({
        "id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": ctx.model_name,
        "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
    })  # fmt: skip


class PoolingRequest(ClassifyRequest):
    """`POST /pooling` (vLLM's): one input or several, as text or token ids."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None


async def create_pooling(ctx: ServingContext, req: PoolingRequest, raw: Request) -> JSONResponse:
    """`POST /pooling` on a native model: each input's pooled output as the model gives it, vLLM's
    one route for every pooling model: an embedding model's embedding (its pooling and
    normalisation, `dimensions` cut), a classifier's label probabilities, a cross-encoder's or a
    reward model's score (a one-label head's, after its activation)."""
    engine = ctx.engine.engine
    if engine.is_classifier:
        if req.dimensions is not None:
            raise APIError(
                400, "dimensions applies to embeddings; this model is a classifier", param="dimensions"
            )
        processed, vectors = await classify_outputs(ctx, raw, req)
    else:
        if req.truncate_prompt_tokens is not None:
            raise APIError(
                400, "truncate_prompt_tokens applies to classifiers here; /v1/embeddings inputs must fit",
                param="truncate_prompt_tokens",
            )  # fmt: skip
        if req.dimensions is not None and req.dimensions < 1:
            raise APIError(400, f"dimensions must be >= 1; got {req.dimensions}", param="dimensions")
        inputs = [req.input] if isinstance(req.input, str) or (
            req.input and all(isinstance(t, int) for t in req.input)
        ) else list(req.input)  # fmt: skip
        if not inputs:
            raise APIError(400, "input must not be empty", param="input")
        processed, vectors = await embed(ctx, raw, inputs, req.dimensions, truncate=False)  # type: ignore[arg-type]
    encode = encode_vector if req.encoding_format == "base64" else list
    num_tokens = sum(len(p.token_ids) for p in processed)
    return JSONResponse({
        "id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": ctx.model_name,
        "data": [{"index": i, "object": "pooling", "data": encode(v)} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
    })  # fmt: skip
