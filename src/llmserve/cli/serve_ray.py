"""`llmserve serve --replicas N`: the same server as N engine replicas on Ray Serve, behind one
OpenAI-compatible ingress (llmserve.ray_serve), a thin wrapper over `serve.run`.

    llmserve serve ./model --replicas 2                          # a local Ray cluster
    llmserve serve ./model --replicas 1 --max-replicas 4 --ray-address auto   # autoscaled, on a cluster

The server flags that shape requests (limits, parsers, metrics) apply in every replica; the
application listens on --host/--port and checks --api-key. One model only. On a local cluster,
`--ray-http-proxy` picks the front (ray_serve/application.py):

    direct   (default) HAProxy asks the prefix router which replica takes each request and sends
             it straight there; the replica serves HTTP itself (one Python hop)
    haproxy  HAProxy before the ingress deployment, which forwards through a handle (two hops)
    serve    Serve's Python proxy before the ingress (three)

A cluster joined with --ray-address runs whichever its Serve was started with: the direct front
where this process has ray_serve/env.py's DIRECT_ENV set (as the cluster's processes must), else
the ingress.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os

APP_NAME = "llmserve"
FRONT_OF = {"direct": "direct", "haproxy": "ingress", "serve": "ingress"}
"""--ray-http-proxy -> the application's `front` on a local cluster."""

logger = logging.getLogger("llmserve")

# each replica's app: these ServerConfig fields are the ingress's (or Ray's) business there
_INGRESS_FIELDS = {"host", "port", "grpc_port", "api_key", "allowed_origins", "otlp_traces_endpoint"} | {
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
}  # fmt: skip


def add_ray_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("replicas on Ray Serve (pip install 'llmserve[ray]')")
    r.add_argument(
        "--replicas", type=int, default=None,
        help="serve the model as this many engine replicas on Ray Serve behind one ingress "
        "(prefix-aware routing, /metrics labelled by replica)",
    )  # fmt: skip
    r.add_argument(
        "--max-replicas", type=int, default=None,
        help="with --replicas: autoscale between --replicas and this many on queue length",
    )  # fmt: skip
    r.add_argument(
        "--target-ongoing-requests", type=float, default=8.0,
        help="autoscaling's target of requests held per replica (running + queued)",
    )  # fmt: skip
    r.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (default: start a local one; 'auto': the running one)",
    )
    r.add_argument(
        "--max-replicas-per-node", type=int, default=None,
        help="at most this many replicas on one Ray node (1: spread them, one per node)",
    )  # fmt: skip
    r.add_argument(
        "--ray-http-proxy", choices=tuple(FRONT_OF), default="direct",
        help="the front on a local cluster: direct (HAProxy sends each request to the replica the "
        "prefix router picks), haproxy (HAProxy before an ingress deployment) or serve (Serve's "
        "Python proxy before the ingress)",
    )  # fmt: skip
    r.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")


def ray_serve_options(args: argparse.Namespace):  # -> RayServeOptions (the ray extra may be absent)
    """The Ray Serve application's options from `llmserve serve`'s arguments; ValueError for what
    the replicas cannot serve."""
    from llmserve.cli.engine_args import llm_kwargs
    from llmserve.cli.serve import model_specs, server_config
    from llmserve.ray_serve import RayServeOptions

    specs = model_specs(args)
    if len(specs) != 1 or specs[0].engine != "native":
        raise ValueError("--replicas serves one native model (give one MODEL)")
    config = server_config(args)
    if config.ssl_certfile or config.grpc_port is not None or config.allowed_origins:
        raise ValueError(
            "--replicas: TLS, --grpc-port and --allowed-origins are not served through Ray Serve"
        )
    server_options = {k: v for k, v in dataclasses.asdict(config).items() if k not in _INGRESS_FIELDS}
    return RayServeOptions(
        front=FRONT_OF[args.ray_http_proxy] if args.ray_address is None else "auto",
        model=specs[0].source, served_model_name=specs[0].name, num_replicas=args.replicas,
        min_replicas=args.replicas, max_replicas=args.max_replicas, max_replicas_per_node=args.max_replicas_per_node,
        target_ongoing_requests=args.target_ongoing_requests, api_key=config.api_key,
        otlp_traces_endpoint=config.otlp_traces_endpoint,
        replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus, server_options=server_options,
        engine_options={k: v for k, v in llm_kwargs(args).items() if k != "model"},
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.ray_address is None:  # Ray Serve reads them when first imported, here and in every process
        os.environ.update(local_cluster_env(args))
    try:
        import ray
        from ray import serve

        from llmserve.ray_serve import build_application
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'llmserve[ray]' ({e})") from None
    options = ray_serve_options(args)
    application = build_application(options)
    needed = cpus_needed(options)
    if args.ray_address is None:  # a local cluster: room for every replica (Ray's CPUs are logical)
        cores = os.cpu_count() or 1
        ray.init(num_cpus=max(cores, math.ceil(needed)))
        if needed > cores:
            logger.warning("the replicas (%s Ray CPUs each) and the ingress need %.2f CPUs; this "
                           "machine has %d cores, which they share", options.replica_cpus, needed, cores)  # fmt: skip
    else:
        ray.init(address=args.ray_address)
        have = ray.cluster_resources().get("CPU", 0.0)
        if have < needed:  # Ray waits for them (an autoscaling cluster may add nodes): say so
            logger.warning("the Ray cluster has %.2f CPUs; the replicas (%s CPUs each) and the "
                           "ingress need %.2f, so some wait for resources (lower --replica-cpus or "
                           "add nodes)", have, options.replica_cpus, needed)  # fmt: skip
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C (serve.run blocks until then): take the application down
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0


def local_cluster_env(args: argparse.Namespace) -> dict[str, str]:
    """Ray Serve's environment flags for the local cluster that `--replicas` starts."""
    from llmserve.ray_serve.env import DIRECT_ENV, HAPROXY_ENV

    return {"direct": DIRECT_ENV, "haproxy": HAPROXY_ENV, "serve": {}}[args.ray_http_proxy].copy()


def cpus_needed(options) -> float:
    """Ray CPUs the application's first replicas reserve: the engine replicas and the ingress (or
    the direct front's router)."""
    replicas = options.num_replicas if options.max_replicas is None else options.min_replicas
    return replicas * options.replica_cpus + options.ingress_cpus
