"""server/media.py: what an image URL may name and how much of it is read, against a real local
HTTP server (remote images) and real files (the allowed folder, links out of it)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.config import ServerConfig
from llmserve.server.errors import APIError
from llmserve.server.media import load_image

FIELD = "messages[0].content[0].image_url"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(2)
        body = bytes(4096) if self.path == "/big" else b"\x89PNG fake"
        try:
            self.send_response(404 if self.path == "/missing" else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (the timeout test)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def load(url: str, **config: object) -> bytes:
    return asyncio.run(load_image(url, ServerConfig(**config), FIELD))  # type: ignore[arg-type]


def refused(url: str, match: str, **config: object) -> None:
    with pytest.raises(APIError) as e:
        load(url, **config)
    assert e.value.status == 400 and e.value.param == FIELD and match in str(e.value)


def test_data_urls() -> None:
    assert load("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    refused("data:image/png;base64,@@", "not valid base64")
    refused("data:image/png,abc", "must be data:<type>;base64")
    refused(
        "data:image/png;base64," + base64.b64encode(bytes(2048)).decode(),
        "larger than 1024",
        media_max_bytes=1024,
    )


def test_remote_only_when_allowed_and_within_limits(http_url: str) -> None:
    refused(f"{http_url}/cat.png", "remote images are not allowed")
    assert load(f"{http_url}/cat.png", allow_remote_media=True) == b"\x89PNG fake"
    refused(f"{http_url}/big", "larger than 1024", allow_remote_media=True, media_max_bytes=1024)
    refused(f"{http_url}/missing", "answered 404", allow_remote_media=True)
    refused(f"{http_url}/slow", "could not fetch", allow_remote_media=True, media_timeout=0.5)


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(b"cat")
    (tmp_path / "secret.png").write_bytes(b"secret")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    refused(str(allowed / "cat.png"), "local files are not allowed")
    ok = {"allowed_local_media_path": str(allowed)}
    assert load(str(allowed / "cat.png"), **ok) == b"cat"
    assert load((allowed / "cat.png").as_uri(), **ok) == b"cat"
    refused(str(allowed / ".." / "secret.png"), "not under the allowed media folder", **ok)
    refused(str(allowed / "link.png"), "not under the allowed media folder", **ok)  # a link out
    refused(str(allowed / "none.png"), "cannot read", **ok)
    refused(str(allowed / "cat.png"), "larger than 2", media_max_bytes=2, **ok)
