"""The real server in a subprocess, on a tiny real model (random weights, a real tokenizer and chat
template), driven over HTTP by the `openai` client and httpx."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.models.tiny import make_tiny_model, make_tiny_model_eos0

if TYPE_CHECKING:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

# ChatML, as SmolLM2 and Qwen use it; the tiny vocabulary spells the markers as plain text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_NAME = "tiny-llama"


def make_tiny_chat_model(folder: Path) -> Path:
    """A tiny random Llama in `folder` whose tokenizer carries CHAT_TEMPLATE."""
    make_tiny_model("llama", folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-llama"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`llmserve serve` in a subprocess; `start()` returns once /health answers 200."""

    def __init__(
        self, model: Path | str | list[str], *args: str, env: dict[str, str] | None = None,
        log_dir: Path | None = None, module: str = "llmserve.cli.main", served_name: str | None = MODEL_NAME,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        """`model`: a model folder or file (the log goes beside it) or a name such as the embedded
        model's (give `log_dir` then), or several MODEL arguments (give `log_dir`). `module`: what
        `python -m` runs (the CLI, or a test wrapper). `served_name`: --served-model-name. `tls`:
        the server speaks https (give its --ssl-* flags), reached with this client context."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.tls = tls
        models = [str(m) for m in model] if isinstance(model, list) else [str(model)]
        self.log_path = (log_dir or Path(models[0]).parent) / f"server-{self.port}.log"
        cmd = [
            sys.executable, "-m", module, "serve", *models, "--port", str(self.port),
            *(["--served-model-name", served_name] if served_name else []),
            "--num-kv-blocks", "256", "--max-num-seqs", "8", *args,
        ]  # fmt: skip
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def start(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=self.tls or True).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One shared server per test module, default settings."""
    proc = ServerProcess(tiny_model_dir).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def so_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server on the tiny Llama with EOS = <|endoftext|> only (transformers' default EOS id is a
    quote in this vocabulary) and the ChatML template: for structured outputs and tool calls."""
    folder = tmp_path_factory.mktemp("so-server")
    make_tiny_model_eos0(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    proc = ServerProcess(folder).start()
    yield proc
    proc.stop()


# -- OpenTelemetry: an in-process OTLP/gRPC collector (test_tracing.py, test_ray_serve.py) ----------


class Collector:
    """An OTLP trace receiver (opentelemetry-proto's `TraceService`, served by the `collector`
    fixture) that keeps every span it is sent (with its resource's attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, object], Span]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # the gRPC method's name
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        with self._lock:
            for rs in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((resource, span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, trace_id: bytes, count: int, timeout: float = 30.0) -> list[Span]:
        """The spans of `trace_id`, once `count` of them arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for _, s in self.spans if s.trace_id == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{len(found)} of {count} spans of trace {trace_id.hex()} arrived")


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def span_attrs(span: Span) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in span.attributes}


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    """A collector on a free local port: (the receiver, the port)."""
    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(grace=None)


def new_traceparent() -> tuple[bytes, bytes, str]:
    """(trace id, the caller's span id, the W3C `traceparent` header naming both)."""
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return trace_id, span_id, f"00-{trace_id.hex()}-{span_id.hex()}-01"
