"""The Ray Serve application: N `EngineReplica`s of one model behind one of two fronts.

    serve run llmserve.ray_serve:app model=PATH num_replicas=2 [front=auto|direct|ingress]
        [api_key=...] [ENGINE OPTION=...]
    llmserve serve PATH --replicas 2 [--ray-address ADDR]

    front=direct   HAProxy asks `PrefixRouter` which replica takes a request, then sends it
                   straight to that replica, which serves HTTP itself (direct.py); needs
                   Ray Serve's HAProxy mode with body forwarding (direct.DIRECT_ENV)
    front=ingress  an `Ingress` deployment takes every request (behind HAProxy or Serve's
                   proxy) and forwards it to a replica through a `DeploymentHandle` (ingress.py)
    front=auto     direct where this process's Ray Serve runs with DIRECT_ENV, else ingress

`app(args)` is the builder `serve run` calls with the `key=value` arguments; `RayServeOptions`
reads them (numbers as text, unknown names refused, like every other llmserve option source); the
engine options left over go to each replica's engine (config/engine_args.py checks them).

Autoscaling: with `max_replicas`, Ray scales the replicas between `min_replicas` and
`max_replicas` to keep `target_ongoing_requests` per replica. A replica's ongoing requests are
every request it holds, running or waiting in its engine's queue, so this is autoscaling on queue
length with Ray's own autoscaler.
"""

from __future__ import annotations

import dataclasses
import shlex
import typing
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve._private import constants as serve_constants
from ray.serve.config import RequestRouterConfig

from llmserve.config.engine_args import EngineArgs
from llmserve.config.models import ModelSpec
from llmserve.model_executor.model_loader.source import DEFAULT_MODEL
from llmserve.ray_serve.direct import ROUTING_STATS_PERIOD_S, DirectEngineReplica, PrefixRouter
from llmserve.ray_serve.env import DIRECT_ENV, HAPROXY_ENV  # noqa: F401 (HAPROXY_ENV: re-exported)
from llmserve.ray_serve.ingress import Ingress
from llmserve.ray_serve.replica import EngineReplica
from llmserve.ray_serve.router import PrefixAwareRouter

QUIET = {"enable_access_log": False}
"""No line per request in Ray's logs (the plain server keeps uvicorn's access log off too;
`--log-requests` still logs each request in the replica's app)."""

FRONTS = ("auto", "direct", "ingress")


@dataclass(frozen=True)
class RayServeOptions:
    """The application's options; the field docstrings are the `key=value` arguments' help."""

    front: str = "auto"
    """What takes HTTP: `direct` (HAProxy to the replica its router picks), `ingress` (an ingress
    deployment before the replicas) or `auto` (direct where Ray Serve runs with DIRECT_ENV)."""
    model: str | None = None
    """A model folder, a .gguf file or a bundled name (None: the embedded default model)."""
    served_model_name: str | None = None
    """What clients put in `model` (default: `model`)."""
    num_replicas: int = 1
    """Engine replicas (without `max_replicas`: a fixed number)."""
    min_replicas: int = 1
    """With `max_replicas`: the fewest replicas the autoscaler keeps."""
    max_replicas: int | None = None
    """Autoscale up to this many replicas on queue length (`target_ongoing_requests`)."""
    target_ongoing_requests: float = 8.0
    """Autoscaling's target of requests held per replica (running + waiting in its engine)."""
    upscale_delay_s: float = 30.0
    """With `max_replicas`: how long the load must stay above the target before a replica is added
    (Ray's default)."""
    downscale_delay_s: float = 600.0
    """With `max_replicas`: how long it must stay below before one is removed (Ray's default)."""
    max_ongoing_requests: int = 64
    """Requests one replica holds at most; more wait in the ingress's router (front=direct: the
    router does not reserve slots, so Ray's direct ingress applies it in the replica)."""
    api_key: str | None = None
    """Clients must send this key (as the plain server's --api-key)."""
    max_replicas_per_node: int | None = None
    """At most this many replicas on one Ray node (1: one per node, spreading them over the
    cluster); None: Ray places them where there is room."""
    replica_cpus: float = 1.0
    """Ray CPUs reserved for each replica."""
    replica_gpus: float = 0.0
    """Ray GPUs reserved for each replica."""
    ingress_cpus: float = 0.25
    """Ray CPUs reserved for each ingress replica (front=direct: the prefix router's)."""
    torch_threads: int | None = None
    """torch's intra-op threads in each replica (None: torch's default)."""
    prefix_blocks: int = 4
    """How many of the prompt's first KV blocks the routing key hashes."""
    imbalance: int = 4
    """Requests ahead of the least loaded replica that make a prefix's home busy."""
    otlp_traces_endpoint: str | None = None
    """An OTLP/gRPC collector for OpenTelemetry spans (the `otel` extra): the ingress's span of each
    request and, its child, the replica's `llm_request` span."""
    server_options: dict[str, Any] = field(default_factory=dict)
    """`ServerConfig` fields for each replica's app (limits, parsers); the key is the ingress's."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Every other argument: the engine's options (those of `llmserve serve`, underscored)."""

    def __post_init__(self) -> None:
        if self.front not in FRONTS:
            raise ValueError(f"front must be one of {', '.join(FRONTS)} (got {self.front!r})")
        if self.num_replicas < 1 or self.min_replicas < 1:
            raise ValueError(
                f"num_replicas and min_replicas must be >= 1 (got {self.num_replicas}, {self.min_replicas})"
            )
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise ValueError(f"max_replicas_per_node must be >= 1 (got {self.max_replicas_per_node})")
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayServeOptions:
        """`serve run`'s `key=value` arguments (text) or a dict of typed values."""
        hints = typing.get_type_hints(cls)
        own = {f.name for f in dataclasses.fields(cls)} - {"engine_options", "server_options"}
        values: dict[str, Any] = {}
        for name, value in args.items():
            if name in own:
                values[name] = _convert(name, value, hints[name])
        return cls(**values, engine_options={k: v for k, v in args.items() if k not in own})


def _convert(name: str, value: Any, hint: Any) -> Any:
    if not isinstance(value, str) or hint in (str, str | None):
        return value
    if value.lower() in ("", "none", "null") and type(None) in typing.get_args(hint):
        return None
    kind = next(t for t in (int, float, str) if t is hint or t in typing.get_args(hint))
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected {kind.__name__}") from None


def build_application(options: RayServeOptions) -> Application:
    """The replicas' deployment behind the front `options.front` names (`resolve_front`)."""
    name = options.served_model_name or options.model or DEFAULT_MODEL
    spec = ModelSpec(name=name, source=options.model, preload=True)
    # unknown names and bad values are refused here, before any replica starts
    block_size = EngineArgs.from_options(
        options.engine_options, where="the replicas' engine options"
    ).block_size
    direct = resolve_front(options.front) == "direct"
    server_options = {
        **options.server_options, "served_model_name": spec.name,
        "otlp_traces_endpoint": options.otlp_traces_endpoint,
    }  # fmt: skip
    if direct:  # the replica's own app checks the key
        server_options["api_key"] = options.api_key
    replicas = serve.deployment(
        DirectEngineReplica if direct else EngineReplica,
        name="EngineReplica",
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"imbalance": options.imbalance},
            **({"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S} if direct else {}),
        ),
        health_check_period_s=2.0,
        logging_config=QUIET,
        **_scaling(options),
    ).bind(spec, options.engine_options, server_options, options.torch_threads)
    front_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": options.ingress_cpus},
        "logging_config": QUIET,
    }
    if direct:
        router = serve.deployment(PrefixRouter, name="PrefixRouter", **front_options)
        return replicas._with_ingress_request_router(
            router.bind(replicas, options.model, block_size, options.prefix_blocks)
        )
    ingress = serve.deployment(Ingress, name="Ingress", **front_options)
    return ingress.bind(
        replicas,
        options.model,
        options.api_key,
        block_size,
        options.prefix_blocks,
        options.otlp_traces_endpoint,
    )


def resolve_front(front: str) -> str:
    """`direct` or `ingress` for an options' `front`; ValueError for `direct` where this process's
    Ray Serve does not run with DIRECT_ENV (Ray reads it when it is first imported)."""
    ready = (
        serve_constants.RAY_SERVE_ENABLE_HA_PROXY
        and serve_constants.RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY
    )
    if front == "auto":
        return "direct" if ready else "ingress"
    if front == "direct" and not ready:
        flags = " ".join(f"{k}={shlex.quote(v)}" for k, v in DIRECT_ENV.items())
        raise ValueError(
            f"front=direct needs Ray Serve started with {flags} (every Ray process), or front=ingress"
        )
    return front


def _scaling(options: RayServeOptions) -> dict[str, Any]:
    """The replicas' count: fixed, or autoscaled on ongoing requests."""
    scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.max_replicas_per_node is not None:
        scaling["max_replicas_per_node"] = options.max_replicas_per_node
    if options.max_replicas is not None:
        scaling |= {
            "num_replicas": "auto",
            "autoscaling_config": {
                "min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                "target_ongoing_requests": options.target_ongoing_requests,
                "upscale_delay_s": options.upscale_delay_s, "downscale_delay_s": options.downscale_delay_s,
            },
        }  # fmt: skip
    return scaling


def app(args: dict[str, Any]) -> Application:
    """`serve run llmserve.ray_serve:app model=... num_replicas=2`'s application builder."""
    return build_application(RayServeOptions.from_args(args))
