"""The direct front's pure parts (ray_serve/direct.py): the router's key of a raw request body is
the ingress's key of the validated request (bodies it cannot key: None), the replicas' own load
orders the two choices where Ray has no queue lengths (a pick-only router takes the first), the
front option (auto / direct / ingress, direct refused without Ray's flags) and what reaches Ray:
the replicas as the HTTP deployment, the router attached as its ingress request router."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private import constants as serve_constants
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from llmserve.config.engine_args import EngineArgs
from llmserve.ray_serve import RayServeOptions, build_application
from llmserve.ray_serve.application import resolve_front
from llmserve.ray_serve.direct import ROUTING_STATS_PERIOD_S
from llmserve.ray_serve.prefix import PrefixKeyer
from llmserve.ray_serve.router import ONGOING_STAT, PREFIX_KEY, PrefixAwareRouter
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.test_ray_serve_routing import keyer, model_dir  # noqa: F401 (fixtures: 3 blocks of 16)


def body_key(prefix_keyer: PrefixKeyer, body: bytes) -> int | None:
    return prefix_keyer.body_key(body)


def test_the_routers_key_of_a_body_is_the_ingress_key(keyer: PrefixKeyer) -> None:  # noqa: F811
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hi"}],
    }
    completion = {"model": "m", "prompt": "Once upon a time " * 20, "max_tokens": 1}
    ids = {"model": "m", "prompt": list(range(3, 60))}
    assert body_key(keyer, json.dumps(chat).encode()) == keyer.chat_key(
        ChatCompletionRequest.model_validate(chat)
    )
    assert body_key(keyer, json.dumps(completion).encode()) == keyer.completion_key(
        CompletionRequest.model_validate(completion)
    )
    assert body_key(keyer, json.dumps(ids).encode()) == keyer.ids_key(list(range(3, 51)))
    assert body_key(keyer, json.dumps(chat).encode()) is not None
    # what it cannot key goes by load (the replica refuses what is invalid)
    for body in (b"", b"{not json", b"[1, 2]", json.dumps(completion).encode()[:40],
                 json.dumps({"model": "m", "messages": "hi"}).encode(),  # invalid: the replica's 400
                 json.dumps({"model": "m", "input": "an embedding"}).encode()):  # fmt: skip
        assert body_key(keyer, body) is None, body


def make_router(loads: dict[str, int], cached: dict[str, int]) -> tuple[PrefixAwareRouter, list]:
    """Replicas with their own counts (`loads`: routing stats) and, for some, Ray's (`cached`)."""
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(imbalance=2)
    replicas = []
    for name, load in loads.items():
        replica_id = ReplicaID(name, DeploymentID("EngineReplica", "app"))
        if name in cached:
            router._replica_queue_len_cache.update(replica_id, cached[name])
        replicas.append(SimpleNamespace(replica_id=replica_id, routing_stats={ONGOING_STAT: load}))
    return router, replicas


def test_pick_only_routing_orders_by_the_replicas_own_load() -> None:
    router, replicas = make_router({"a": 5, "b": 1}, cached={})
    pending = SimpleNamespace(kwargs={PREFIX_KEY: None})
    for _ in range(10):  # two replicas: the two choices are both, the less loaded first
        (rank,) = asyncio.run(router.choose_replicas(replicas, pending))
        assert [r.replica_id.unique_id for r in rank] == ["b", "a"]
    # Ray's own queue length, where it has one, wins over the replica's count
    router, replicas = make_router({"a": 5, "b": 1}, cached={"a": 0, "b": 3})
    (rank,) = asyncio.run(router.choose_replicas(replicas, pending))
    assert [r.replica_id.unique_id for r in rank] == ["a", "b"]
    # a key's home that is `imbalance` ahead by its own count is skipped
    router, replicas = make_router({"a": 4, "b": 0}, cached={})
    for key in range(40):
        ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(kwargs={PREFIX_KEY: key})))
        assert ranks[0][0].replica_id.unique_id == "b"


def test_the_front_option(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="front must be one of auto, direct, ingress"):
        RayServeOptions(front="nginx")
    for flags in ((False, False), (True, False)):
        monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", flags[0])
        monkeypatch.setattr(serve_constants, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", flags[1])
        assert resolve_front("auto") == "ingress" and resolve_front("ingress") == "ingress"
        with pytest.raises(ValueError, match="RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1"):
            build_application(RayServeOptions(front="direct"))
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_constants, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", True)
    assert resolve_front("auto") == "direct" == resolve_front("direct")


def test_the_direct_application_reaches_ray(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_constants, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", True)
    options = RayServeOptions(model=str(model_dir), num_replicas=2, api_key="k", prefix_blocks=3)
    application = build_application(options)
    replicas = application._bound_deployment  # Ray's own objects
    assert replicas.name == "EngineReplica" and replicas.num_replicas == 2
    assert replicas.init_args[2]["api_key"] == "k"  # the replica's app checks the key itself
    routing = replicas._deployment_config.request_router_config
    assert routing.request_router_class.endswith("router.PrefixAwareRouter")
    assert routing.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S
    router = application._ingress_request_router._bound_deployment
    assert router.name == "PrefixRouter"
    block_size = EngineArgs.from_options({}, where="test").block_size
    assert router.init_args[0] is application and router.init_args[1:] == (str(model_dir), block_size, 3)
