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
