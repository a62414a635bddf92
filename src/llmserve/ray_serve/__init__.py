"""llmserve on Ray Serve: N engine replicas behind one OpenAI-compatible ingress (an optional
extra: `pip install 'llmserve[ray]'`).

    application.py  `app` / `build_application`: the deployments and their options
    ingress.py      `Ingress`: auth and validation (the plain server's), prefix keys, relaying
    router.py       `PrefixAwareRouter`: a prefix's home replica, else power of two choices
    prefix.py       the routing key: the hash of the prompt's first KV blocks
    replica.py      `EngineReplica`: a whole llmserve app in-process, driven over ASGI
    metrics.py      every replica's metrics on the ingress's /metrics, labelled by replica
"""

from llmserve.ray_serve.application import RayServeOptions, app, build_application

__all__ = ["RayServeOptions", "app", "build_application"]
