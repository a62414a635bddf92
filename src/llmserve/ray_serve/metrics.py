"""Metrics from every replica, labelled by replica, on /metrics.

A scrape of /metrics (the ingress's, or under the direct front any replica's) asks every live replica for its Prometheus text at once (Ray Serve's
`DeploymentHandle.broadcast`: the replica's `metrics_text`, the /metrics answer of the llmserve
app it runs) and merges the texts into one exposition, each sample with a `replica` label added:

    replica a: llmserve:prompt_tokens_total{model_name="m"} 12
    replica b: llmserve:prompt_tokens_total{model_name="m"} 30
      -> llmserve:prompt_tokens_total{model_name="m",replica="a"} 12
         llmserve:prompt_tokens_total{model_name="m",replica="b"} 30   (one HELP/TYPE for both)

A replica that does not answer in time (dying, starting) is left out of that scrape. The texts are
parsed and written back with prometheus-client, so the merge is a valid exposition (each family's
samples together, whatever order the replicas listed them in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

REPLICA_LABEL = "replica"
METRICS_TIMEOUT = 5.0
"""Seconds a scrape waits for the replicas' texts (one that is later is left out)."""


class _Merged:
    """A prometheus-client collector that yields the merged families."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self):  # prometheus-client's collector protocol
        merged = {}
        for replica_id, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                target = merged.setdefault(family.name, family)
                samples = [
                    Sample(s.name, {**s.labels, REPLICA_LABEL: replica_id}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                ]
                if target is family:
                    family.samples = samples
                else:
                    target.samples.extend(samples)
        yield from merged.values()


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One Prometheus exposition of every replica's text, each sample labelled by its replica."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)


async def gather_metrics(replicas: DeploymentHandle) -> bytes:
    """Every live replica's metrics (its `metrics_text`), merged."""
    answers = await replicas.broadcast("metrics_text").results_async(
        timeout_s=METRICS_TIMEOUT, return_exceptions=True
    )
    return merge_metrics(dict(a for a in answers if isinstance(a, tuple)))
