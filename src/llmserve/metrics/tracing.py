"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, vLLM's flag): one span per finished
request, exported over OTLP/gRPC, so a request can be followed from whatever called the server
(a Ray Serve ingress, a gateway) into the engine.

    HTTP request with `traceparent`  (W3C trace context; server/middleware.py's `TraceContext`
        |                             makes it the current OpenTelemetry context of the request;
        |                             a gRPC call's metadata likewise)
    AsyncEngine.add_request          captures the current context with the request
        |
    the request's last output        `RequestTracer.record`: the span, started at arrival
        v
    llm_request   [arrival ........................................ finish]   kind SERVER
      queue       [arrival .. first scheduled]
      prefill                [first scheduled .. first token]
      decode                                    [first token ........ last token]

The parent span's attributes use vLLM's names (the `gen_ai.*` semantic conventions where they
exist): request id, model, sampling parameters, prompt and completion token counts, and the
latencies the Prometheus histograms already measure (metrics/stats.py), read from the request's
`RequestMetrics` (monotonic seconds, turned into wall-clock nanoseconds when the span is made).
The phase spans are llmserve's addition: the same intervals, drawn on the trace's timeline.

On Ray Serve (llmserve.ray_serve) the ingress makes a span of its own, `IngressTracer`: a child of
the client's `traceparent`, covering the request's forwarding to a replica and its whole answer,
and itself the parent the replica's app sees (its `traceparent` replaces the client's in the
forwarded headers), so one trace runs client -> ray_serve_ingress -> llm_request -> phases.

A gRPC call's `traceparent` metadata is read the same way (server/oip/service.py). A request
aborted (a client that went away, shutdown) leaves no span. The SDK and the exporter are the optional `otel`
extra; without the flag nothing here is imported and requests pay nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from llmserve.engine.llm_engine import ProcessedPrompt
    from llmserve.outputs import RequestOutput

SERVICE_NAME = "llmserve"
SPAN_NAME = "llm_request"
INGRESS_SPAN_NAME = "ray_serve_ingress"
TRACE_HEADERS = (b"traceparent", b"tracestate")


class SpanAttributes:
    """Attribute names, vLLM's (vllm/tracing.py) where it has one."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"  # llmserve's: prefix-cache hits
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # the ingress's span: OpenTelemetry's HTTP names, and the replica that answered
    HTTP_METHOD = "http.request.method"
    HTTP_ROUTE = "url.path"
    HTTP_STATUS_CODE = "http.response.status_code"
    REPLICA = "llmserve.replica"


def otel_import_error(e: ImportError) -> ValueError:
    """A start-up refusal (the CLI prints it as one line, like a bad flag)."""
    return ValueError(
        f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporter: "
        f"pip install 'llmserve[otel]' ({e})"
    )


def make_tracer_provider(endpoint: str) -> TracerProvider:
    """A provider that batches finished spans to an OTLP/gRPC collector at `endpoint`
    (`host:port` or `http://host:port`; plain text unless it says `https://`). The OTEL_BSP_*
    environment variables tune the batching, as with any OpenTelemetry SDK."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise otel_import_error(e) from e
    insecure = not endpoint.startswith("https://")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", SERVICE_NAME)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    return provider


def extract_context(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    """The OpenTelemetry context an HTTP request's W3C `traceparent`/`tracestate` headers carry
    (an empty one without them: the request's span is then a trace's root)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    return TraceContextTextMapPropagator().extract(carrier)


class RequestTracer:
    """One served model's spans, through the server's shared `TracerProvider`."""

    def __init__(self, provider: TracerProvider, model_name: str) -> None:
        from llmserve import __version__

        self.tracer = provider.get_tracer("llmserve", __version__)
        self.model_name = model_name

    @staticmethod
    def current_context() -> Context:
        """The caller's context (its task's, set by the HTTP middleware): the future span's parent."""
        from opentelemetry import context

        return context.get_current()

    def record(self, out: RequestOutput, prompt: ProcessedPrompt, parent: Context | None) -> None:
        """The finished request `out`'s span and its phases' (call once, on its last output)."""
        from opentelemetry.trace import SpanKind

        m = out.metrics
        if m is None:
            return
        finished = m.finished_time if m.finished_time is not None else time.monotonic()
        # monotonic seconds -> wall-clock nanoseconds (OTLP timestamps are Unix epoch ns)
        offset = time.time() - time.monotonic()

        def ns(t: float) -> int:
            return int((t + offset) * 1e9)

        span = self.tracer.start_span(
            SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=ns(m.arrival_time),
            attributes=self._attributes(out, prompt, finished),
        )  # fmt: skip
        phases = (
            ("queue", m.arrival_time, m.first_scheduled_time),
            ("prefill", m.first_scheduled_time, m.first_token_time),
            ("decode", m.first_token_time, m.last_token_time),
        )
        from opentelemetry import trace

        inside = trace.set_span_in_context(span)
        for name, start, end in phases:
            if start is not None and end is not None:  # a phase the request reached
                self.tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(end))
        span.end(end_time=ns(finished))

    def _attributes(self, out: RequestOutput, prompt: ProcessedPrompt, finished: float) -> dict[str, Any]:
        m = out.metrics
        assert m is not None
        a = SpanAttributes
        params = prompt.params
        attrs: dict[str, Any] = {
            a.REQUEST_ID: out.request_id,
            a.RESPONSE_MODEL: self.model_name,
            a.REQUEST_MAX_TOKENS: prompt.max_tokens,
            a.REQUEST_TEMPERATURE: params.temperature,
            a.REQUEST_TOP_P: params.top_p,
            a.REQUEST_N: params.n,
            a.USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
            a.USAGE_COMPLETION_TOKENS: m.num_generation_tokens,
            a.USAGE_CACHED_TOKENS: out.num_cached_tokens,
            a.USAGE_NUM_SEQUENCES: len(out.outputs),
            a.FINISH_REASONS: [c.finish_reason or "" for c in out.outputs],
            a.LATENCY_E2E: finished - m.arrival_time,
        }
        intervals = (
            (a.LATENCY_TIME_IN_QUEUE, m.arrival_time, m.first_scheduled_time),
            (a.LATENCY_TIME_TO_FIRST_TOKEN, m.arrival_time, m.first_token_time),
            (a.LATENCY_TIME_IN_MODEL_PREFILL, m.first_scheduled_time, m.first_token_time),
            (a.LATENCY_TIME_IN_MODEL_DECODE, m.first_token_time, m.last_token_time),
            (a.LATENCY_TIME_IN_MODEL_INFERENCE, m.first_scheduled_time, m.last_token_time),
        )
        for name, start, end in intervals:
            if start is not None and end is not None:
                attrs[name] = end - start
        return attrs


class IngressTracer:
    """The Ray Serve ingress's spans (one per forwarded request), through its `TracerProvider`."""

    def __init__(self, provider: TracerProvider) -> None:
        from llmserve import __version__

        self.tracer = provider.get_tracer("llmserve.ray_serve", __version__)

    def start(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Span, list[tuple[bytes, bytes]]]:
        """A request's span, the child of its `headers`' trace context (a new trace without one),
        and the headers to forward: the same, with this span's `traceparent` instead of the
        caller's. End the span with `finish`."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        a = SpanAttributes
        span = self.tracer.start_span(
            INGRESS_SPAN_NAME, context=extract_context(headers), kind=SpanKind.SERVER,
            attributes={a.HTTP_METHOD: method, a.HTTP_ROUTE: path},
        )  # fmt: skip
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        forwarded = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
        forwarded += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
        return span, forwarded

    @staticmethod
    def finish(span: Span, status: int, replica: str | None = None, error: str | None = None) -> None:
        """End `span` with the answer's status, the replica that gave it and, for a failure (a
        5xx, a stream cut off), the error."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute(SpanAttributes.HTTP_STATUS_CODE, status)
        if replica is not None:
            span.set_attribute(SpanAttributes.REPLICA, replica)
        if error is not None or status >= 500:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
