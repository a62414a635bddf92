"""The request side shared by completions and chat: caps on n and logprobs, sampling parameters,
checking a prompt against the model, and queueing a request's prompts (or none of them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from llmserve.engine.async_engine import EngineDeadError, QueueFullError, RequestStream
from llmserve.engine.llm_engine import ProcessedPrompt
from llmserve.multimodal.qwen_vl_video import DEFAULT_FPS, Video
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import APIError
from llmserve.server.media import load_image
from llmserve.server.protocol import VideoURLPart, _SamplingFields
from llmserve.server.serving.context import ServingContext
from llmserve.server.serving.structured import structured_outputs

logger = logging.getLogger("llmserve.server")


def check_caps(ctx: ServingContext, req: _SamplingFields, logprobs: int | None, logprobs_name: str) -> None:
    cfg = ctx.config
    if not 1 <= req.n <= cfg.max_n:
        raise APIError(400, f"n must be in [1, {cfg.max_n}]; got {req.n}", param="n")
    if logprobs is not None and not 0 <= logprobs <= cfg.max_logprobs:
        raise APIError(
            400, f"{logprobs_name} must be in [0, {cfg.max_logprobs}]; got {logprobs}", param=logprobs_name
        )
    check_stop(ctx, [req.stop] if isinstance(req.stop, str) else (req.stop or []), "stop")


def check_stop(ctx: ServingContext, stop: list[str], name: str) -> None:
    """The server's caps on stop strings (how many, how long); `name`: the request's field."""
    cfg = ctx.config
    if len(stop) > cfg.max_stop:
        raise APIError(400, f"{name} has {len(stop)} strings; at most {cfg.max_stop} are allowed", param=name)
    for s in stop:
        if not s or len(s) > cfg.max_stop_length:
            raise APIError(
                400,
                f"each string in {name} must have 1 to {cfg.max_stop_length} characters; got {len(s)}",
                param=name,
            )


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids; got {key!r}", param="logit_bias"
            ) from None
        out[token] = value
    return out


def sampling_params(
    req: _SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's parameters for a request; range errors become a 400 naming the parameter."""
    constraint, _ = structured_outputs(req)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias(req.logit_bias),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=constraint,
        )
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


async def load_images(ctx: ServingContext, urls: list[tuple[str, str]], field: str) -> list[bytes]:
    """The encoded images (field, URL) name, within the server's media settings (server/media.py);
    a model that takes no images answers 400 naming `field`."""
    if not urls:
        return []
    if not ctx.engine.takes_images:
        raise APIError(400, f"{field}: model {ctx.model_name!r} takes no images (text only)", param=field)
    return [await load_image(url, ctx.config, param) for param, url in urls]


async def load_videos(ctx: ServingContext, parts: list[tuple[str, VideoURLPart]]) -> list[Video]:
    """Each video part's frames (image URLs under the server's media settings) as a `Video`; a
    model that takes no videos, or a video file's URL (no decoder here), answers 400 naming the
    part."""
    videos = []
    for field, part in parts:
        if not ctx.engine.takes_videos:
            raise APIError(400, f"{field}: model {ctx.model_name!r} takes no videos", param=field)
        urls = part.video_url.url
        if isinstance(urls, str):
            raise APIError(
                400, f"{field}.url: this server decodes no video files; send the video's frames as a list "
                "of image URLs (data URLs, or paths and URLs under the media settings)", param=f"{field}.url",
            )  # fmt: skip
        frames = [await load_image(url, ctx.config, f"{field}.url[{k}]") for k, url in enumerate(urls)]
        videos.append(Video(frames, float(part.video_url.fps or DEFAULT_FPS)))
    return videos


async def process_prompt(
    ctx: ServingContext,
    prompt: str | Sequence[int],
    params: SamplingParams,
    req: _SamplingFields | None = None,
    images: Sequence[bytes] = (),
    add_special_tokens: bool = True,
    image_fields: Sequence[str] = (),
    videos: Sequence[Video] = (),
    video_fields: Sequence[str] = (),
) -> ProcessedPrompt:
    """Tokenize and check one prompt (with its images: one per image marker of the text); a
    prompt that cannot fit is a 400 with both numbers, an invalid structured-output constraint a
    400 naming the field it came in, an image that does not decode a 400 naming it."""
    ctx.check_generates()
    try:
        return await ctx.engine.process_inputs(prompt, params, images, add_special_tokens, videos)
    except ValueError as e:
        param = getattr(e, "param", None)
        for kind, fields in (("images", image_fields), ("videos", video_fields)):
            if param is not None and param.startswith(f"{kind}[") and fields:
                field = fields[int(param[len(kind) + 1 : -1])]  # the engine's image i: the request's field
                raise APIError(400, f"{field}: {e}", param=field) from None
        if param == "structured_outputs" and req is not None:
            param = structured_outputs(req)[1] or param
        raise APIError(400, str(e), param=param) from None


def start_requests(
    ctx: ServingContext, prompts: list[ProcessedPrompt], priority: int, prefix: str, final_only: bool = False
) -> list[RequestStream]:
    """Queue every prompt of one API request, or none of them (429 when the queue is full).
    `final_only`: a response sent whole (no stream) reads each request's output once, finished."""
    engine = ctx.engine
    num_sequences = sum(p.params.n for p in prompts)
    limit = ctx.config.max_queued_requests
    if limit is not None and num_sequences > max(limit, 1):
        # retrying could never help: the request alone is larger than the queue
        raise APIError(
            400, f"this request needs {num_sequences} sequences (prompts x n); the server queues at most {limit}",
            param="n",
        )  # fmt: skip
    try:
        engine.check_queue(num_sequences)
    except QueueFullError as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    streams = [
        engine.add_request(
            engine.new_request_id(prefix), p, priority, ctx.lora_request, final_only=final_only
        )
        for p in prompts
    ]
    for stream in streams:
        p = stream.prompt
        logger.info(
            "request %s: %d prompt tokens, n=%d, max_tokens=%d%s",
            stream.request_id, len(p.token_ids), p.params.n, p.max_tokens,
            f", prompt={p.text if p.text is not None else p.token_ids!r}" if ctx.config.log_requests else "",
        )  # fmt: skip
    return streams
