"""llmserve on Ray Serve: N engine replicas behind one OpenAI-compatible ingress (an optional
extra: `pip install 'llmserve[ray]'`).

    application.py  `app` / `build_application`: the deployments, their options, the front
    env.py          Ray Serve's environment flags for each front (imports nothing of Ray)
    haproxy_wrapper.py  Ray's HAProxy with the API's errors: JSON 5xx pages, SSE error events
    direct.py       the direct front: `PrefixRouter` (HAProxy asks it), `DirectEngineReplica`
    ingress.py      `Ingress`: auth and validation (the plain server's), prefix keys, relaying
    router.py       `PrefixAwareRouter`: a prefix's home replica, else power of two choices
    prefix.py       the routing key: the hash of the prompt's first KV blocks
    replica.py      `EngineReplica`: a whole llmserve app in-process, driven over ASGI
    metrics.py      every replica's metrics on the ingress's /metrics, labelled by replica
"""

from typing import Any

__all__ = ["RayServeOptions", "app", "build_application"]


def __getattr__(name: str) -> Any:
    """The application's names, imported on first use: importing this package (env.py) must not
    import Ray Serve, which reads its environment flags once, when first imported."""
    if name in __all__:
        from llmserve.ray_serve import application

        return getattr(application, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
