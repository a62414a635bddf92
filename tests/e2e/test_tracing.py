"""`--otlp-traces-endpoint`: the real server exports one span per request to a real OTLP/gRPC
collector running in the test process (opentelemetry-proto's `TraceService`), and the spans are
checked field by field: the caller's `traceparent` is the parent, the token counts are the
response's `usage`, the latencies are the phases' spans, and the phases nest inside the request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.e2e.conftest import MODEL_NAME, Collector, ServerProcess, new_traceparent, span_attrs

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def traced_server(tiny_model_dir: Path, collector: tuple[Collector, int]) -> Iterator[ServerProcess]:
    _, port = collector
    # export each span within 50 ms instead of the SDK's default 5 s
    proc = ServerProcess(
        tiny_model_dir, "--otlp-traces-endpoint", f"127.0.0.1:{port}", env={"OTEL_BSP_SCHEDULE_DELAY": "50"}
    ).start()
    yield proc
    proc.stop()


def test_a_request_is_a_child_of_the_callers_span(traced_server, collector):
    receiver, _ = collector
    trace_id, caller_span, header = new_traceparent()
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 6, "temperature": 0.0}
    r = httpx.post(f"{traced_server.url}/v1/completions", json=body, headers={"traceparent": header})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]

    spans = {s.name: s for s in receiver.wait_for(trace_id, 4)}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    request = spans["llm_request"]
    assert request.parent_span_id == caller_span
    assert request.kind == Span.SPAN_KIND_SERVER
    attrs = span_attrs(request)
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert attrs["gen_ai.response.model"] == MODEL_NAME
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert f"request {attrs['gen_ai.request.id']}: " in traced_server.log()

    # the phases: children of the request's span, one after the other, inside it, and their
    # lengths are the latency attributes
    seconds = 1e-9
    start, end = request.start_time_unix_nano, request.end_time_unix_nano
    previous_end = start
    for name, attr in (
        ("queue", "gen_ai.latency.time_in_queue"),
        ("prefill", "gen_ai.latency.time_in_model_prefill"),
        ("decode", "gen_ai.latency.time_in_model_decode"),
    ):
        phase = spans[name]
        assert phase.parent_span_id == request.span_id
        assert previous_end <= phase.start_time_unix_nano <= phase.end_time_unix_nano <= end
        assert (phase.end_time_unix_nano - phase.start_time_unix_nano) * seconds == pytest.approx(
            attrs[attr], abs=2e-6
        )
        previous_end = phase.end_time_unix_nano
    assert (end - start) * seconds == pytest.approx(attrs["gen_ai.latency.e2e"], abs=2e-6)
    ttft = attrs["gen_ai.latency.time_to_first_token"]
    assert ttft == pytest.approx(
        attrs["gen_ai.latency.time_in_queue"] + attrs["gen_ai.latency.time_in_model_prefill"]
    )
    # the span is wall-clock time: it happened during this test
    assert abs(end * seconds - time.time()) < 60


def test_a_streamed_chat_without_traceparent_starts_its_own_trace(traced_server, collector):
    receiver, _ = collector
    client = traced_server.client()
    before = {s.span_id for _, s in receiver.spans}
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = [s for _, s in receiver.spans if s.span_id not in before and s.name == "llm_request"]
        if new:
            break
        time.sleep(0.05)
    assert len(new) == 1, "one span per API request (its n samples are one engine request)"
    request = new[0]
    assert request.parent_span_id == b""  # a root span
    attrs = span_attrs(request)
    assert attrs["gen_ai.request.n"] == attrs["gen_ai.usage.num_sequences"] == 2
    assert attrs["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 8
    # the engine's request id, the one the server's log lines name
    assert f"request {attrs['gen_ai.request.id']}: " in traced_server.log()
    resource = next(r for r, s in receiver.spans if s.span_id == request.span_id)
    assert resource["service.name"] == "llmserve"
    spans = receiver.wait_for(request.trace_id, 4)
    assert sorted(s.name for s in spans) == ["decode", "llm_request", "prefill", "queue"]


def test_a_bad_traceparent_is_ignored(traced_server, collector):
    """A malformed header is no error: the request is served and its span is a root."""
    receiver, _ = collector
    before = len(receiver.spans)
    r = httpx.post(
        f"{traced_server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
        headers={"traceparent": "00-not-a-trace-01"},
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(receiver.spans) < before + 4:
        time.sleep(0.05)
    roots = [s for _, s in receiver.spans[before:] if s.name == "llm_request"]
    assert len(roots) == 1 and roots[0].parent_span_id == b""


def test_a_grpc_call_is_a_child_of_its_traceparent_metadata(tiny_model_dir: Path, collector):
    """`--grpc-port`: the call's `traceparent` metadata is the span's parent; a later call
    without one is a root again (the context ends with its call)."""
    from llmserve.server.oip import inference_pb2 as pb
    from llmserve.server.oip import inference_pb2_grpc as pb_grpc
    from tests.e2e.conftest import free_port

    receiver, port = collector
    grpc_port = free_port()
    proc = ServerProcess(
        tiny_model_dir, "--grpc-port", str(grpc_port), "--otlp-traces-endpoint", f"127.0.0.1:{port}",
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).start()  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            def infer(metadata: tuple[tuple[str, str], ...]) -> None:
                request = pb.ModelInferRequest(model_name=MODEL_NAME, id="r")
                tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
                tensor.contents.bytes_contents.append(b"Hello")
                request.parameters["max_tokens"].int64_param = 3
                stub.ModelInfer(request, metadata=metadata)

            trace_id, caller_span, header = new_traceparent()
            infer((("traceparent", header),))
            spans = {s.name: s for s in receiver.wait_for(trace_id, 4)}
            request = spans["llm_request"]
            assert request.parent_span_id == caller_span
            assert span_attrs(request)["gen_ai.usage.completion_tokens"] == 3

            before = len(receiver.spans)
            infer(())
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(receiver.spans) < before + 4:
                time.sleep(0.05)
            (root,) = [s for _, s in receiver.spans[before:] if s.name == "llm_request"]
            assert root.parent_span_id == b"" and root.trace_id != trace_id
    finally:
        proc.stop()
