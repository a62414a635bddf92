"""The web playground: static pages shipped in the package (server/static/, plain HTML, CSS and ES
modules; no build step), served without the API key like llama-server's web UI.

    GET /                      the chat playground (index.html)
    GET /playground/metrics    live charts of /metrics (metrics.html)
    GET /playground/static/*   the pages' scripts and styles

The pages hold no secret and reach the server only through the API, where every call carries the
key the user typed (kept in the browser's localStorage, sent as a bearer token): the gate
(server/middleware.py) leaves these paths open and guards everything else as before.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/playground/static"
PAGES = {"/": "index.html", "/playground/metrics": "metrics.html"}


def is_playground_path(path: str) -> bool:
    """Whether the gate lets `path` through without the key: the pages and their files."""
    return path in PAGES or path.startswith(STATIC_PREFIX + "/")


def _page(name: str):
    async def page() -> FileResponse:
        # no-cache: a browser revalidates (ETag) so an upgraded server's pages show at once
        return FileResponse(STATIC_DIR / name, headers={"Cache-Control": "no-cache"})

    return page


router = APIRouter(include_in_schema=False)
for _path, _name in PAGES.items():
    router.add_api_route(_path, _page(_name), methods=["GET"])

static_files = StaticFiles(directory=STATIC_DIR)
