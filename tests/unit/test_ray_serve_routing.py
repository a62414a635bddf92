"""llmserve.ray_serve's pure parts: the routing key is the engine's own hash of the prompt's first
KV blocks (token ids from transformers' tokenizer and chat template as the reference), rendezvous
hashing moves only a lost replica's keys, the router's ranks (a prefix's home, then power of two;
a busy home skipped), the metrics merge (parsed back with prometheus-client), the options (serve
run's arguments, `llmserve serve --replicas`'s flags) and what reaches Ray's deployment config."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from llmserve.cli import serve
from llmserve.cli.serve_ray import cpus_needed, local_cluster_env, ray_serve_options
from llmserve.core.kv_cache.block_hash import request_block_hashes
from llmserve.core.request import Request
from llmserve.model_executor.model_loader.source import resolve_model
from llmserve.ray_serve import RayServeOptions, build_application
from llmserve.ray_serve.env import DIRECT_ENV, HAPROXY_ENV, WRAPPER
from llmserve.ray_serve.metrics import merge_metrics
from llmserve.ray_serve.prefix import PrefixKeyer, rendezvous_order
from llmserve.ray_serve.router import AVOID_REPLICA, PREFIX_KEY, PrefixAwareRouter
from llmserve.sampling_params import SamplingParams
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.tokenizer import load_tokenizer
from tests.e2e.conftest import make_tiny_chat_model

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-llama-routing"))


@pytest.fixture(scope="module")
def keyer(model_dir: Path) -> PrefixKeyer:
    return PrefixKeyer(load_tokenizer(resolve_model(str(model_dir))), BLOCK, num_blocks=3)


def engine_hash(ids: list[int], num_blocks: int) -> int:
    """The hash the engine's prefix cache gives block `num_blocks - 1` of a prompt."""
    request = Request("r", list(ids), SamplingParams())
    return request_block_hashes(request, BLOCK)[num_blocks - 1]


def test_completion_key_is_the_engines_block_hash(model_dir: Path, keyer: PrefixKeyer) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    ids = reference(prompt)["input_ids"]
    assert len(ids) > 3 * BLOCK
    key = keyer.completion_key(CompletionRequest(model="m", prompt=prompt))
    assert key == engine_hash(ids, 3)
    # token ids, and a batch's first prompt, give the same key
    assert keyer.completion_key(CompletionRequest(model="m", prompt=ids)) == key
    assert keyer.completion_key(CompletionRequest(model="m", prompt=[prompt, "other"])) == key
    # only the first blocks count: a different tail keeps the key, a different head changes it
    assert keyer.text_key(prompt + " and then some more") == key
    assert keyer.text_key("A" + prompt) != key


def test_short_prompts_hash_their_full_blocks_only(keyer: PrefixKeyer) -> None:
    assert keyer.ids_key(list(range(BLOCK - 1))) is None
    assert keyer.ids_key(list(range(BLOCK + 5))) == engine_hash(list(range(BLOCK + 5)), 1)


def test_chat_key_is_the_rendered_conversations_hash(model_dir: Path, keyer: PrefixKeyer) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "You answer questions about geography, briefly. " * 3},
        {"role": "user", "content": "Where is Lima?"},
    ]
    ids = reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    key = keyer.chat_key(ChatCompletionRequest(model="m", messages=messages))
    assert key == engine_hash(list(ids), 3)


def test_rendezvous_moves_only_the_lost_replicas_keys() -> None:
    replicas = ["a", "b", "c"]
    homes = {key: rendezvous_order(key, replicas)[0] for key in range(300)}
    assert {homes[k] for k in homes} == set(replicas)
    after = {key: rendezvous_order(key, ["a", "c"])[0] for key in range(300)}
    assert all(after[k] == homes[k] for k in homes if homes[k] != "b")
    # the order does not depend on how the replicas are listed
    assert all(rendezvous_order(k, ["c", "a", "b"]) == rendezvous_order(k, replicas) for k in range(50))


def make_router(queue_lengths: dict[str, int], imbalance: int = 2) -> tuple[PrefixAwareRouter, list]:
    """The router's policy alone (Ray's routing loop around it is not started)."""
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(imbalance=imbalance)
    replicas = []
    for name, length in queue_lengths.items():
        replica_id = ReplicaID(name, DeploymentID("EngineReplica", "app"))
        router._replica_queue_len_cache.update(replica_id, length)
        replicas.append(SimpleNamespace(replica_id=replica_id))
    return router, replicas


def choose(
    router: PrefixAwareRouter, replicas: list, key: int | None, avoid: str | None = None
) -> list[list]:
    pending = SimpleNamespace(kwargs={PREFIX_KEY: key, AVOID_REPLICA: avoid})
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_router_ranks_the_home_first_then_two_choices() -> None:
    router, replicas = make_router({"a": 0, "b": 0, "c": 0})
    key = 12345
    home = rendezvous_order(key, ["a", "b", "c"])[0]
    ranks = choose(router, replicas, key)
    assert [r.replica_id.unique_id for r in ranks[0]] == [home]
    assert len(ranks[1]) == 2 and len({id(r) for r in ranks[1]}) == 2
    # no key (a prompt shorter than a block): power of two choices only
    assert len(choose(router, replicas, None)) == 1


def test_router_leaves_out_the_replica_a_retry_avoids() -> None:
    """A retry after a replica whose engine died: never that replica while another is left."""
    router, replicas = make_router({"a": 0, "b": 0, "c": 0})
    key = 12345
    home = rendezvous_order(key, ["a", "b", "c"])[0]
    for _ in range(20):
        ranks = choose(router, replicas, key, avoid=home)
        assert all(r.replica_id.unique_id != home for rank in ranks for r in rank)
    assert [r.replica_id.unique_id for r in choose(router, replicas, key, avoid="x")[0]] == [home]
    # the only replica left: still tried (Ray may have replaced the engine by then)
    router, replicas = make_router({"a": 0})
    assert [r.replica_id.unique_id for r in choose(router, replicas, None, avoid="a")[0]] == ["a"]


def test_router_skips_a_busy_home() -> None:
    key = 777
    home = rendezvous_order(key, ["a", "b"])[0]
    other = "b" if home == "a" else "a"
    router, replicas = make_router({home: 5, other: 3}, imbalance=2)  # 2 ahead: busy
    ranks = choose(router, replicas, key)
    assert len(ranks) == 1 and len(ranks[0]) == 2
    router, replicas = make_router({home: 4, other: 3}, imbalance=2)  # 1 ahead: still the home
    assert [r.replica_id.unique_id for r in choose(router, replicas, key)[0]] == [home]
    with pytest.raises(ValueError, match="imbalance"):
        make_router({"a": 0}, imbalance=0)


def test_metrics_merge_labels_every_sample_by_replica() -> None:
    text = (
        "# HELP llmserve:prompt_tokens_total Prefill tokens.\n# TYPE llmserve:prompt_tokens_total counter\n"
        'llmserve:prompt_tokens_total{model_name="m"} 12.0\n'
        "# HELP llmserve:ttft_seconds TTFT.\n# TYPE llmserve:ttft_seconds histogram\n"
        'llmserve:ttft_seconds_bucket{le="0.1",model_name="m"} 1.0\n'
        'llmserve:ttft_seconds_bucket{le="+Inf",model_name="m"} 2.0\n'
        'llmserve:ttft_seconds_count{model_name="m"} 2.0\nllmserve:ttft_seconds_sum{model_name="m"} 0.5\n'
    )
    merged = merge_metrics({"r1": text, "r2": text.replace("12.0", "30.0")}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    counter = families["llmserve:prompt_tokens"]
    assert {(s.labels["replica"], s.value) for s in counter.samples} == {("r1", 12.0), ("r2", 30.0)}
    assert all(s.labels["model_name"] == "m" for s in counter.samples)
    histogram = families["llmserve:ttft_seconds"]
    assert len(histogram.samples) == 2 * 4 and {s.labels["replica"] for s in histogram.samples} == {
        "r1",
        "r2",
    }
    assert merged.count("# TYPE llmserve:ttft_seconds histogram") == 1


def test_options_from_serve_run_arguments(model_dir: Path) -> None:
    options = RayServeOptions.from_args(
        {
            "model": str(model_dir),
            "num_replicas": "2",
            "max_replicas": "4",
            "torch_threads": "1",
            "max_num_seqs": "4",
        }
    )
    assert (options.num_replicas, options.max_replicas, options.torch_threads) == (2, 4, 1)
    assert options.engine_options == {"max_num_seqs": "4"}
    application = build_application(options)  # the engine options are checked here
    assert application is not None
    with pytest.raises(ValueError, match="no_such_option"):
        build_application(RayServeOptions.from_args({"model": str(model_dir), "no_such_option": "1"}))
    with pytest.raises(ValueError, match="num_replicas='two'"):
        RayServeOptions.from_args({"num_replicas": "two"})
    with pytest.raises(ValueError, match="max_replicas"):
        RayServeOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match=r"max_replicas_per_node must be >= 1 \(got 0\)"):
        RayServeOptions.from_args({"max_replicas_per_node": "0"})


def test_autoscaling_on_ongoing_requests_and_the_router_reach_the_deployment() -> None:
    application = build_application(
        RayServeOptions(min_replicas=2, max_replicas=5, target_ongoing_requests=3, upscale_delay_s=5)
    )
    replicas = application._bound_deployment.init_args[0]._bound_deployment  # Ray's own objects
    config = replicas._deployment_config
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 3.0)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (5.0, 600.0)
    assert config.request_router_config.request_router_class.endswith("router.PrefixAwareRouter")
    fixed = (
        build_application(RayServeOptions(num_replicas=3))._bound_deployment.init_args[0]._bound_deployment
    )
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    spread = build_application(RayServeOptions(num_replicas=2, max_replicas_per_node=1))
    assert spread._bound_deployment.init_args[0]._bound_deployment._replica_config.max_replicas_per_node == 1


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_llmserve_serve_replicas_flags(model_dir: Path) -> None:
    options = ray_serve_options(
        serve_args(str(model_dir), "--replicas", "2", "--max-replicas", "4", "--api-key", "k", "--max-n", "3",
                   "--max-num-seqs", "5")
    )  # fmt: skip
    assert (options.num_replicas, options.min_replicas, options.max_replicas) == (2, 2, 4)
    assert options.api_key == "k" and options.model == str(model_dir)
    assert options.server_options["max_n"] == 3 and "api_key" not in options.server_options
    assert options.engine_options["max_num_seqs"] == 5
    assert options.max_replicas_per_node is None
    spread = ray_serve_options(serve_args(str(model_dir), "--replicas", "2", "--max-replicas-per-node", "1"))
    assert spread.max_replicas_per_node == 1
    # the trace endpoint: the ingress's own option, handed to the replicas by build_application
    traced = ray_serve_options(
        serve_args(
            str(model_dir),
            "--replicas",
            "1",
            "--otlp-traces-endpoint",
            "h:4317",
            "--ray-http-proxy",
            "haproxy",
        )
    )
    assert traced.otlp_traces_endpoint == "h:4317" and "otlp_traces_endpoint" not in traced.server_options
    ingress = build_application(traced)._bound_deployment
    assert ingress.init_args[-1] == "h:4317"
    assert ingress.init_args[0]._bound_deployment.init_args[2]["otlp_traces_endpoint"] == "h:4317"
    with pytest.raises(ValueError, match="one native model"):
        ray_serve_options(serve_args(f"a={model_dir}", f"b={model_dir}", "--replicas", "2"))
    with pytest.raises(ValueError, match="TLS"):
        ray_serve_options(serve_args(str(model_dir), "--replicas", "2", "--grpc-port", "9000"))


def test_cpus_a_local_cluster_needs(model_dir: Path) -> None:
    """What `--replicas` reserves in Ray CPUs (a local cluster is started with at least that
    many logical CPUs: 2 replicas of 1 CPU and the ingress did not fit 2 cores, and serve.run
    waited for the ingress forever)."""
    fixed = ray_serve_options(serve_args(str(model_dir), "--replicas", "2"))
    assert cpus_needed(fixed) == 2 * 1.0 + fixed.ingress_cpus == 2.25
    scaled = ray_serve_options(serve_args(str(model_dir), "--replicas", "1", "--max-replicas", "4",
                                          "--replica-cpus", "0.5"))  # fmt: skip
    assert cpus_needed(scaled) == 0.5 + scaled.ingress_cpus


def test_a_local_cluster_runs_the_direct_front_unless_told(model_dir: Path) -> None:
    """`--replicas` sets Ray Serve's HAProxy mode with body forwarding on the cluster it starts and
    the direct front (tests/e2e/test_ray_serve_direct.py); `--ray-http-proxy haproxy` HAProxy
    before the ingress (tests/e2e/test_ray_serve.py checks that HAProxy then listens), `serve`
    Serve's Python proxy; a joined cluster's front follows this process's environment."""
    assert HAPROXY_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert HAPROXY_ENV["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(WRAPPER) and os.access(WRAPPER, os.X_OK)
    assert DIRECT_ENV == {**HAPROXY_ENV, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
    fronts = {"direct": (DIRECT_ENV, "direct"), "haproxy": (HAPROXY_ENV, "ingress"), "serve": ({}, "ingress")}
    for flag, (env, front) in fronts.items():
        args = serve_args(str(model_dir), "--replicas", "2", "--ray-http-proxy", flag)
        assert local_cluster_env(args) == env and ray_serve_options(args).front == front
    default = serve_args(str(model_dir), "--replicas", "2")
    assert local_cluster_env(default) == DIRECT_ENV and ray_serve_options(default).front == "direct"
    joined = serve_args(str(model_dir), "--replicas", "2", "--ray-address", "auto")
    assert ray_serve_options(joined).front == "auto"
    with pytest.raises(SystemExit):
        serve_args(str(model_dir), "--replicas", "2", "--ray-http-proxy", "nginx")
