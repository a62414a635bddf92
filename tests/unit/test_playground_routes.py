"""The playground's routes in the app, without a model (no lifespan: nothing loads): the pages
and their files open without the key, everything else still behind it, and
`enable_playground=False` (`--disable-playground`) serves no page. The pages in a browser:
tests/e2e/test_playground.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Match

from llmserve.config import ServerConfig
from llmserve.config.models import ModelSpec
from llmserve.server.app import build_app
from llmserve.server.playground import STATIC_DIR

KEY = "k"


def client(**config) -> TestClient:
    return TestClient(build_app([ModelSpec("m")], ServerConfig(api_key=KEY, **config)))


@pytest.mark.parametrize(
    ("path", "kind", "file"),
    [("/", "text/html", "index.html"), ("/playground/metrics", "text/html", "metrics.html"),
     ("/playground/static/api.js", "javascript", "api.js"),
     ("/playground/static/style.css", "text/css", "style.css")],
)  # fmt: skip
def test_pages_are_open(path: str, kind: str, file: str) -> None:
    r = client().get(path)
    assert r.status_code == 200 and kind in r.headers["content-type"]
    assert r.content == (STATIC_DIR / file).read_bytes()


@pytest.mark.parametrize(
    "path", ["/v1/models", "/metrics", "/playground", "/playground/other", "/index.html"]
)
def test_everything_else_needs_the_key(path: str) -> None:
    r = client().get(path)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_a_missing_file_is_a_404_and_no_path_leaves_the_folder() -> None:
    c = client()
    assert c.get("/playground/static/nothing.js").status_code == 404
    assert c.get("/playground/static/../playground.py").status_code == 401  # the client resolves the ..
    assert c.get("/playground/static/%2e%2e/playground.py").status_code == 404


def test_disabled_serves_no_page() -> None:
    c = client(enable_playground=False)
    assert c.get("/").status_code == 401
    assert c.get("/playground/static/api.js").status_code == 401
    for path in ("/", "/playground/metrics", "/playground/static/api.js"):
        assert routed(client().app, path) and not routed(c.app, path)


def routed(app, path: str) -> bool:
    """Whether a GET of `path` reaches a route (the gate aside)."""
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)
