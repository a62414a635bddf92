"""The gRPC server (`--grpc-port`): the Open Inference Protocol v2's `GRPCInferenceService`
(inference.proto) on grpc.aio, in the HTTP server's process and event loop (app.py's lifespan
starts and stops it), on the same `ServerState`: the same models, key, caps and metrics.

    ModelInfer / ModelGenerateStream / ModelStreamInfer (Triton's, many requests on one call)
      -> admit: UNAVAILABLE while loading or draining, UNAUTHENTICATED without the key
      -> tensors.completion_request: the /v1/completions request it means (INVALID_ARGUMENT)
      -> ModelManager.lease(model_name) (NOT_FOUND) -> the answer as pieces (serving/pieces.py),
         from a native engine (RESOURCE_EXHAUSTED on a full queue) or a remote upstream
      -> ModelInferResponse(s) with `text_output`

A cancelled call cancels its handler task; leaving the pieces' generator aborts the engine
request (`RequestStream.__aexit__`), whose KV blocks the next step frees. `ServerLive` and
`ServerReady` are open like HTTP's /health (they are the probes); every other RPC needs the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import grpc

from llmserve import __version__
from llmserve.engine.async_engine import EngineDeadError, RequestAbortedError
from llmserve.metrics.tracing import extract_context
from llmserve.server.errors import APIError
from llmserve.server.middleware import REJECT_REASONS, key_matches
from llmserve.server.models import LOADED, ModelSlot
from llmserve.server.oip import inference_pb2 as pb
from llmserve.server.oip import inference_pb2_grpc as pb_grpc
from llmserve.server.oip.tensors import (
    completion_request,
    infer_response,
    model_metadata,
    stream_flag,
)
from llmserve.server.protocol import CompletionRequest
from llmserve.server.serving.inputs import check_caps, sampling_params
from llmserve.server.serving.pieces import Piece, gather, openai_sampling, relay_pieces, start_answer
from llmserve.server.state import ServerState

logger = logging.getLogger("llmserve.server")

# HTTP status of an APIError -> the gRPC status it is answered with
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
}  # fmt: skip


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """`GRPCInferenceService` over the server's models."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        key = state.config.api_key
        self._expected = key.encode() if key else None

    # -- health and metadata ------------------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        return pb.ServerMetadataResponse(name="llmserve", version=__version__)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        slot = await self._call(context, self.state.models.resolve, request.name or None)
        return pb.ModelReadyResponse(ready=slot.state == LOADED)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        slot = await self._call(context, self.state.models.resolve, request.name or None)
        return model_metadata(slot.name, slot.engine)

    # -- generation ---------------------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        try:
            req = completion_request(request)
            async with self._answer(req, whole=True) as (slot, pieces):
                answer = await gather(pieces)
            return infer_response(slot.name, request.id, answer.content, answer.end)
        except (APIError, EngineDeadError, RequestAbortedError) as e:
            await self._abort(context, e)

    async def ModelGenerateStream(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelInferResponse]:
        await self._admit(context)
        try:
            req = completion_request(request)
            async with self._answer(req, whole=False) as (slot, pieces):
                async for piece in pieces:
                    if piece.content or piece.end is not None:
                        yield infer_response(slot.name, request.id, piece.content, piece.end)
        except (APIError, EngineDeadError, RequestAbortedError) as e:
            await self._abort(context, e)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's bidirectional stream: each request read is answered concurrently, its
        responses sent as they come (told apart by `id`), the last one marked
        `triton_final_response`; a failed request is one `error_message` response and the stream
        goes on. The call ends when the client has closed its side and every answer is sent; a
        cancelled call cancels the answers still running (their engine requests are aborted)."""
        await self._admit(context)
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def answer(request: pb.ModelInferRequest) -> None:
            try:
                stream = stream_flag(request)
                req = completion_request(request)
                async with self._answer(req, whole=not stream) as (slot, pieces):
                    if stream:
                        async for piece in pieces:
                            if piece.content or piece.end is not None:
                                response = infer_response(slot.name, request.id, piece.content, piece.end)
                                out.put_nowait(_final(response, piece.end is not None))
                    else:
                        whole = await gather(pieces)
                        response = infer_response(slot.name, request.id, whole.content, whole.end)
                        out.put_nowait(_final(response, True))
            except (APIError, EngineDeadError, RequestAbortedError) as e:
                _, message = self._status(e)
                failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
                out.put_nowait(pb.ModelStreamInferResponse(error_message=message, infer_response=failed))

        async def read() -> None:
            try:
                async for request in requests:
                    task = asyncio.create_task(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.gather(*running)
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
            await reader  # its errors (a broken client stream) end the call
        finally:
            for task in (reader, *running):
                task.cancel()

    @asynccontextmanager
    async def _answer(
        self, req: CompletionRequest, whole: bool
    ) -> AsyncIterator[tuple[ModelSlot, AsyncIterator[Piece]]]:
        """The model `req` names, leased while its answer streams; leaving the block closes the
        pieces at once (`aclosing`), so a cancelled call aborts its engine request then, not when
        the generator is collected. `whole`: the answer is sent in one response (a native engine
        then builds its output once, finished)."""
        async with (
            self.state.models.lease(req.model) as slot,
            aclosing(await self._pieces(slot, req, whole)) as pieces,
        ):
            yield slot, pieces

    async def _pieces(self, slot: ModelSlot, req: CompletionRequest, whole: bool) -> AsyncIterator[Piece]:
        """The answer to `req` as pieces: a native engine's (checked and queued here, so a bad
        value or a full queue fails before the first response) or a remote upstream's."""
        assert isinstance(req.prompt, str), "text_input is one string"
        if slot.remote is not None:
            body = {"prompt": req.prompt, **openai_sampling(sampling_params(req, req.max_tokens, None, None))}
            return relay_pieces(slot.remote, "/v1/completions", body)
        ctx = slot.ctx
        assert ctx is not None, "a leased local model is loaded"
        check_caps(ctx, req, None, "logprobs")
        params = sampling_params(req, req.max_tokens, None, None)
        answer = await start_answer(ctx, req.prompt, params, "grpc", split=False, final_only=whole)
        return answer.pieces

    # -- admission and errors -----------------------------------------------------------------------

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """What HTTP's gate checks before any route: the key, then whether requests can be served.
        With tracing on, the call's `traceparent` metadata becomes its OpenTelemetry context, as
        HTTP's `TraceContext` middleware does: grpc.aio runs each call in a task of its own, so
        the context ends with the call."""
        state = self.state
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        if state.models.tracer_provider is not None:
            from opentelemetry import context as otel_context

            otel_context.attach(extract_context((k.encode(), v.encode()) for k, v in metadata.items()))
        if self._expected is not None:
            auth, key = metadata.get("authorization", ""), metadata.get("x-api-key", "")
            if not key_matches(self._expected, auth.encode(), key.encode()):
                await self._abort(context, APIError(401, "missing or wrong API key: send the metadata "
                                                    "'authorization: Bearer <key>'"))  # fmt: skip
        if state.draining:
            await self._abort(context, APIError(503, "the server is shutting down"))
        if not state.models.started_up:
            await self._abort(context, APIError(503, "the model is still loading; retry shortly"))

    async def _call(self, context: grpc.aio.ServicerContext, fn, *args):
        try:
            return fn(*args)
        except APIError as e:
            await self._abort(context, e)

    async def _abort(self, context: grpc.aio.ServicerContext, e: BaseException) -> None:
        """End the call with the gRPC status `e` means."""
        await context.abort(*self._status(e))

    def _status(self, e: BaseException) -> tuple[grpc.StatusCode, str]:
        """The gRPC status `e` means and its message, which names the field at fault. Refusals
        are counted in the metrics as HTTP's are."""
        if isinstance(e, APIError):
            code = STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL)
            message = e.message
            if e.param and e.param not in message:
                message = f"{e.param}: {message}"
            reason = REJECT_REASONS.get(e.status)
            if reason is not None:
                self.state.record_rejected(reason)
        elif isinstance(e, EngineDeadError):
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        else:  # RequestAbortedError: the server aborted it (shutting down)
            code, message = grpc.StatusCode.ABORTED, str(e)
        return code, message


def _final(response: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    """`response` as a stream response, marked as its request's last when `final` (Triton's
    `triton_final_response` parameter, which Triton's clients wait for)."""
    response.parameters["triton_final_response"].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=response)


async def start_grpc_server(state: ServerState) -> grpc.aio.Server:
    """Listen on `--grpc-port` (TLS with the HTTP server's certificate when it has one)."""
    config = state.config
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(state), server)
    address = f"{config.host}:{config.grpc_port}"
    if config.ssl_certfile is not None:
        chain = Path(config.ssl_certfile).read_bytes()
        key = Path(config.ssl_keyfile).read_bytes() if config.ssl_keyfile else chain
        roots = Path(config.ssl_ca_certs).read_bytes() if config.ssl_ca_certs else None
        credentials = grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=roots, require_client_auth=config.ssl_cert_reqs == 2
        )
        server.add_secure_port(address, credentials)
    else:
        server.add_insecure_port(address)
    await server.start()
    logger.info("gRPC (Open Inference Protocol v2) listening on %s", address)
    return server
