"""The Open Inference Protocol v2 over gRPC (`--grpc-port`), driven by a grpcio client against the
real server: generation equal to /v1/completions' greedy text, bad requests with the field named in
the status, auth, a full queue, and a cancelled stream that frees its request and KV blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

grpc = pytest.importorskip("grpc")

from llmserve.server.oip import inference_pb2 as pb  # noqa: E402
from llmserve.server.oip import inference_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.conftest import MODEL_NAME, ServerProcess, free_port  # noqa: E402

KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "Hello there, how"


@pytest.fixture(scope="module")
def grpc_server(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, pb_grpc.GRPCInferenceServiceStub]]:
    port = free_port()
    proc = ServerProcess(tiny_model_dir, "--grpc-port", str(port), "--api-key", KEY).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield proc, pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()
    proc.stop()


def infer_request(text: str | None = PROMPT, model: str = MODEL_NAME, **params) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id="req-1")
    if text is not None:
        tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(text.encode())
    for name, value in params.items():
        kind = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[
            type(value)
        ]
        setattr(request.parameters[name], kind, value)
    return request


def text_of(response: pb.ModelInferResponse) -> str:
    (out,) = response.outputs
    assert out.name == "text_output" and out.datatype == "BYTES"
    return out.contents.bytes_contents[0].decode()


def http(proc: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(
        method, proc.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs
    )


def test_health_and_metadata(grpc_server) -> None:
    _, stub = grpc_server
    assert stub.ServerLive(pb.ServerLiveRequest()).live  # open, like /health
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL_NAME), metadata=AUTH).ready
    assert stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=AUTH).name == "llmserve"
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL_NAME), metadata=AUTH)
    assert meta.name == MODEL_NAME
    assert [(t.name, t.datatype) for t in meta.inputs] == [("text_input", "BYTES")]
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]


@pytest.mark.parametrize("max_tokens", [1, 12])
def test_generation_equals_completions(grpc_server, max_tokens: int) -> None:
    proc, stub = grpc_server
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    expected = http(proc, "POST", "/v1/completions", json=body).json()["choices"][0]
    request = infer_request(max_tokens=max_tokens, temperature=0.0)
    unary = stub.ModelInfer(request, metadata=AUTH)
    assert text_of(unary) == expected["text"]
    assert unary.model_name == MODEL_NAME and unary.id == "req-1"
    assert unary.parameters["finish_reason"].string_param == expected["finish_reason"]
    streamed = list(stub.ModelGenerateStream(request, metadata=AUTH))
    assert "".join(text_of(r) for r in streamed) == expected["text"]
    assert streamed[-1].parameters["finish_reason"].string_param == expected["finish_reason"]
    assert streamed[-1].parameters["num_output_tokens"].int64_param <= max_tokens


def test_raw_input_contents(grpc_server) -> None:
    _, stub = grpc_server
    request = pb.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    data = PROMPT.encode()
    request.raw_input_contents.append(len(data).to_bytes(4, "little") + data)
    request.parameters["max_tokens"].int64_param = 4
    request.parameters["temperature"].int64_param = 0
    expected = stub.ModelInfer(infer_request(max_tokens=4, temperature=0.0), metadata=AUTH)
    assert text_of(stub.ModelInfer(request, metadata=AUTH)) == text_of(expected)


BAD = [
    (infer_request(None), "INVALID_ARGUMENT", "text_input"),
    (infer_request(model="no-such-model"), "NOT_FOUND", "no-such-model"),
    (infer_request(max_tokens=-1), "INVALID_ARGUMENT", "max_tokens"),
    (infer_request(temperature=-1.0), "INVALID_ARGUMENT", "temperature"),
    (infer_request(top_p="high"), "INVALID_ARGUMENT", "top_p"),
    (infer_request(max_tokens=1.5), "INVALID_ARGUMENT", "max_tokens"),
    (infer_request(colour="red"), "INVALID_ARGUMENT", "colour"),
]


def _wrong_datatype() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="text_input", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    return request


def _two_strings() -> pb.ModelInferRequest:
    request = infer_request()
    request.inputs[0].shape[:] = [2]
    request.inputs[0].contents.bytes_contents.append(b"second")
    return request


BAD += [(_wrong_datatype(), "INVALID_ARGUMENT", "BYTES"), (_two_strings(), "INVALID_ARGUMENT", "text_input")]


@pytest.mark.parametrize("rpc", ["ModelInfer", "ModelGenerateStream"])
@pytest.mark.parametrize(("request_", "code", "named"), BAD)
def test_bad_requests(grpc_server, rpc: str, request_, code: str, named: str) -> None:
    _, stub = grpc_server
    with pytest.raises(grpc.RpcError) as err:
        result = getattr(stub, rpc)(request_, metadata=AUTH)
        list(result) if rpc == "ModelGenerateStream" else None
    assert err.value.code() == getattr(grpc.StatusCode, code)
    assert named in err.value.details()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)])
def test_auth(grpc_server, metadata) -> None:
    proc, stub = grpc_server
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(infer_request(max_tokens=1), metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in err.value.details()
    assert 'reason="auth"' in http(proc, "GET", "/metrics").text


def _stats(proc: ServerProcess) -> dict:
    return http(proc, "GET", "/stats").json()


def test_cancelled_stream_frees_its_request(grpc_server) -> None:
    proc, stub = grpc_server
    request = infer_request(max_tokens=200, ignore_eos=True, temperature=0.0)
    call = stub.ModelGenerateStream(request, metadata=AUTH)
    for seen, _ in enumerate(call):
        if seen == 3:
            break
    assert _stats(proc)["num_active_requests"] == 1
    call.cancel()
    deadline = time.monotonic() + 10
    while (s := _stats(proc))["num_active_requests"] or s["kv_blocks_used"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s["num_running"] == s["num_waiting"] == 0
    # the aborted request is counted like HTTP's
    assert 'finished_reason="abort"' in http(proc, "GET", "/metrics").text


def test_full_queue_is_resource_exhausted(tiny_model_dir: Path) -> None:
    port = free_port()
    proc = ServerProcess(tiny_model_dir, "--grpc-port", str(port), "--max-queued-requests", "1",
                         "--max-num-seqs", "1").start()  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            long = infer_request(max_tokens=200, ignore_eos=True)
            running = stub.ModelGenerateStream(long)
            next(running)  # the one slot is taken
            waiting = stub.ModelGenerateStream(long)  # the one place in the queue is taken
            deadline = time.monotonic() + 10
            while _stats(proc)["num_waiting"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(infer_request(max_tokens=1))
            running.cancel()
            waiting.cancel()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "busy" in err.value.details()
    finally:
        proc.stop()


def _by_id(responses) -> dict[str, list[pb.ModelStreamInferResponse]]:
    out: dict[str, list] = {}
    for r in responses:
        out.setdefault(r.infer_response.id, []).append(r)
    return out


def test_stream_infer_many_requests_on_one_call(grpc_server) -> None:
    """Triton's ModelStreamInfer: three requests on one call, answered concurrently; each one's
    text equals /v1/completions' greedy text, its last response (and only that one) is marked
    final; one bad request gets an error response naming the field and the others still finish."""
    proc, stub = grpc_server
    prompts = {"a": ("Hello there, how", 12, True), "b": ("The capital of France is", 6, False)}
    requests = []
    for rid, (prompt, n, stream) in prompts.items():
        request = infer_request(prompt, max_tokens=n, temperature=0.0, stream=stream)
        request.id = rid
        requests.append(request)
    bad = infer_request(max_tokens=-1)
    bad.id = "bad"
    requests.insert(1, bad)
    got = _by_id(stub.ModelStreamInfer(iter(requests), metadata=AUTH))
    assert set(got) == {"a", "b", "bad"}
    (error,) = got.pop("bad")
    assert "max_tokens" in error.error_message and not error.infer_response.outputs
    for rid, (prompt, n, stream) in prompts.items():
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
        expected = http(proc, "POST", "/v1/completions", json=body).json()["choices"][0]
        responses = got[rid]
        assert not any(r.error_message for r in responses)
        assert "".join(text_of(r.infer_response) for r in responses) == expected["text"]
        final = [r.infer_response.parameters["triton_final_response"].bool_param for r in responses]
        assert final == [False] * (len(responses) - 1) + [True]
        assert (
            responses[-1].infer_response.parameters["finish_reason"].string_param == expected["finish_reason"]
        )
        # streamed: one response per delta the reader took; a reader that fell behind the engine
        # gets the waiting steps as one delta (async_engine.merge_deltas), so how many is load's
        assert stream or len(responses) == 1


def test_stream_infer_needs_the_key_and_a_bool_stream(grpc_server) -> None:
    _, stub = grpc_server
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ModelStreamInfer(iter([infer_request(max_tokens=1)])))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (only,) = stub.ModelStreamInfer(iter([infer_request(max_tokens=1, stream="yes")]), metadata=AUTH)
    assert "parameters.stream" in only.error_message


def test_cancelled_stream_infer_frees_its_requests(grpc_server) -> None:
    proc, stub = grpc_server
    long = infer_request(max_tokens=200, ignore_eos=True, temperature=0.0)
    call = stub.ModelStreamInfer(iter([long, long]), metadata=AUTH)
    for seen, _ in enumerate(call):
        if seen == 3:
            break
    call.cancel()
    deadline = time.monotonic() + 10
    while (s := _stats(proc))["num_active_requests"] or s["kv_blocks_used"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_whole_answers_read_one_output_and_streams_every_step(tiny_model_dir: Path, monkeypatch) -> None:
    """ModelInfer and a ModelStreamInfer request without `stream` are answered whole: the engine is
    asked for their final output only (`final_only`); a streamed request reads every step's delta.
    The app and its gRPC server in this process, the engine's adds recorded."""
    from fastapi.testclient import TestClient

    from llmserve.config import ServerConfig
    from llmserve.config.models import ModelSpec
    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.server.app import build_app

    asked: list[bool] = []
    add = AsyncEngine.add_request

    def recorded_add(self, *args, **kwargs):
        asked.append(kwargs.get("final_only", False))
        return add(self, *args, **kwargs)

    monkeypatch.setattr(AsyncEngine, "add_request", recorded_add)
    port = free_port()
    app = build_app([ModelSpec(MODEL_NAME, str(tiny_model_dir))], ServerConfig(grpc_port=port))
    with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        whole = text_of(stub.ModelInfer(infer_request(max_tokens=5, temperature=0.0)))
        assert asked == [True] and whole
        for stream, final_only in ((False, True), (True, False)):
            asked.clear()
            request = infer_request(max_tokens=5, temperature=0.0, stream=stream)
            responses = list(stub.ModelStreamInfer(iter([request])))
            assert asked == [final_only]
            assert "".join(text_of(r.infer_response) for r in responses) == whole
            # whole: one response; streamed: a token each, then the end
            assert (len(responses) == 1) if final_only else (len(responses) >= 5)
