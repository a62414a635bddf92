"""An image named in a request -> its encoded bytes, within the server's media settings.

    data:image/png;base64,....     always (the bytes are in the request)
    /path/x.png, file:///path/x    only under --allowed-local-media-path (resolved, links followed)
    http(s)://...                  only with --allow-remote-media, within --media-timeout

Every source is cut at --media-max-size. A refusal is an `APIError` 400 naming the field the image
came in (`messages[0].content[1].image_url`, `images[0]`); decoding the bytes is the engine's
(multimodal/image.py), whose errors name the same field.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from llmserve.config import ServerConfig
from llmserve.server.errors import APIError


async def load_image(url: str, config: ServerConfig, param: str) -> bytes:
    """The encoded image `url` names (see the module docstring for what is allowed)."""
    if url.startswith("data:"):
        return decode_base64(_data_url_payload(url, param), config, param)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        return await _download(url, config, param)
    if scheme in ("", "file"):
        return await asyncio.to_thread(_read_local, url, config, param)
    raise APIError(400, f"{param}: unsupported URL scheme {scheme!r} (data, file or http(s))", param=param)


def decode_base64(payload: str, config: ServerConfig, param: str) -> bytes:
    """Base64 (standard alphabet, padding checked) -> bytes, at most `media_max_bytes`."""
    if len(payload) * 3 // 4 > config.media_max_bytes + 3:
        raise APIError(400, f"{param}: image larger than {config.media_max_bytes} bytes", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: not valid base64", param=param) from None


def _data_url_payload(url: str, param: str) -> str:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise APIError(400, f"{param}: a data URL must be data:<type>;base64,<data>", param=param)
    if not head[5:].startswith("image/"):
        raise APIError(400, f"{param}: a data URL must hold an image/* type; got {head[5:-7]!r}", param=param)
    return payload


def _read_local(url: str, config: ServerConfig, param: str) -> bytes:
    if config.allowed_local_media_path is None:
        raise APIError(400, f"{param}: local files are not allowed (--allowed-local-media-path)", param=param)
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url)
    root = Path(config.allowed_local_media_path).resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise APIError(400, f"{param}: {str(path)!r} is not under the allowed media folder", param=param)
    try:
        size = resolved.stat().st_size
        if size > config.media_max_bytes:
            raise APIError(400, f"{param}: image larger than {config.media_max_bytes} bytes", param=param)
        return resolved.read_bytes()
    except OSError as e:
        raise APIError(400, f"{param}: cannot read {str(path)!r} ({e.strerror})", param=param) from None


async def _download(url: str, config: ServerConfig, param: str) -> bytes:
    if not config.allow_remote_media:
        raise APIError(400, f"{param}: remote images are not allowed (--allow-remote-media)", param=param)
    limit = config.media_max_bytes

    async def fetch() -> bytes:
        async with (
            httpx.AsyncClient(timeout=config.media_timeout, follow_redirects=True) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise APIError(400, f"{param}: {url} answered {response.status_code}", param=param)
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise APIError(400, f"{param}: image larger than {limit} bytes", param=param)
                chunks.append(chunk)
            return b"".join(chunks)

    try:  # the whole download within the timeout, not only each read
        return await asyncio.wait_for(fetch(), config.media_timeout)
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        raise APIError(400, f"{param}: could not fetch {url} ({type(e).__name__})", param=param) from None
