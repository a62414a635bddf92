"""Was the machine quiet? The CPU time that neither the server, nor the load generator, nor this
script spent while a level ran, as a fraction of the machine (wall time x cores).

On a 2-core machine shared with other work (a test run in the same checkout), one busy process
halves a server's speed without a trace in its own figures; this puts the trace in the report.
Busy time comes from /proc/stat's first line (user + nice + system + irq + softirq; steal, the
hypervisor's, is reported apart), the server's from /proc/PID/stat of its process tree, the load
generator's from getrusage(RUSAGE_CHILDREN) (it is a finished child), this script's from
RUSAGE_SELF. Linux only; {} elsewhere.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cpu_scale.memory import process_tree

NOISY = 0.05
"""Above this fraction of the machine spent elsewhere, a level is marked disturbed."""


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all CPUs since boot."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return user + nice + system + irq + softirq, steal


def _tree_ticks(pid: int) -> int:
    """utime + stime of `pid` and its descendants (every thread's included)."""
    total = 0
    for p in process_tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0], utime [11]
        total += int(fields[11]) + int(fields[12])
    return total


def _rusage_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@contextmanager
def other_load(server_pid: int, out: dict[str, Any]) -> Iterator[None]:
    """Fill `out` with what else used the CPU while the body ran (fractions of wall x cores)."""
    if not Path("/proc/stat").is_file():
        yield
        return
    tick = os.sysconf("SC_CLK_TCK")
    cores = len(os.sched_getaffinity(0))
    busy0, steal0 = _machine_ticks()
    server0, children0, self0 = (
        _tree_ticks(server_pid),
        _rusage_s(resource.RUSAGE_CHILDREN),
        _rusage_s(resource.RUSAGE_SELF),
    )
    start = time.perf_counter()
    yield
    wall = time.perf_counter() - start
    busy1, steal1 = _machine_ticks()
    server_s = (_tree_ticks(server_pid) - server0) / tick
    client_s = _rusage_s(resource.RUSAGE_CHILDREN) - children0
    self_s = _rusage_s(resource.RUSAGE_SELF) - self0
    capacity = wall * cores
    other_s = (busy1 - busy0) / tick - server_s - client_s - self_s
    out.update(
        server_cpu_fraction=server_s / capacity,
        client_cpu_fraction=client_s / capacity,
        other_cpu_fraction=max(0.0, other_s) / capacity,
        steal_fraction=(steal1 - steal0) / tick / capacity,
    )
