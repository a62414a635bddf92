"""Starting a local Ray cluster in the tests, again when its start-up times out.

Ray waits a fixed 30 s for a new node's raylet to register with its GCS and then gives up with
"The current node timed out during startup". On a loaded 2-core machine (a full test run beside
other work) that start-up can take longer once, which is Ray's weather, not the test's subject: the
start is retried after stopping whatever half-started.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ATTEMPTS = 3


def start_ray(start: Callable[[], T]) -> T:
    """`start()` (a `ray.init` or a `Cluster`), retried after a start-up timeout."""
    import ray

    for attempt in range(ATTEMPTS):
        try:
            return start()
        except Exception as e:  # Ray raises a plain Exception for the timeout
            if "timed out during startup" not in str(e) or attempt == ATTEMPTS - 1:
                raise
            ray.shutdown()
            ray_cli = Path(sys.executable).with_name("ray")
            subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=120, check=False)
    raise AssertionError("unreachable")


def start_two_nodes(num_cpus: int, log_to_driver: bool):
    """A local two-node Ray cluster (a head and one more node, `num_cpus` Ray CPUs each, no
    dashboard) with this process connected to it: the `Cluster`, its start retried as `start_ray`'s."""
    import ray
    from ray.cluster_utils import Cluster

    def start() -> Cluster:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": num_cpus, "include_dashboard": False}
        )
        cluster.add_node(num_cpus=num_cpus)
        ray.init(address=cluster.address, log_to_driver=log_to_driver)
        cluster.wait_for_nodes()
        return cluster

    return start_ray(start)
