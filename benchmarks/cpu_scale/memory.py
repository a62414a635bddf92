"""Memory, both ways: how fast this machine streams it, and how much a server holds.

    bandwidth   torch's sum over a float32 buffer many times the L3's size, on every core the
                servers get, median of several passes: GB/s a decode step could read weights at.
                The streaming floor of a file is that bandwidth / the file's tensor bytes (a decode
                step at batch 1 reads every matrix once; the tied embedding, as the LM head, too)
    RssWatch    a server's resident memory from /proc while it runs: the process tree's summed VmRSS
                sampled every 0.2 s (its anon / file / shmem parts at the peak), and each process's
                VmHWM (the kernel's own peak, load included) at the end. Linux only; empty elsewhere

Does not know the servers or the table.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

SAMPLE_EVERY_S = 0.2
RSS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def measure_bandwidth(num_bytes: int, num_passes: int, num_threads: int) -> dict[str, Any]:
    """Read bandwidth in GB/s (1e9 bytes), median of `num_passes` timed sums after one untimed pass
    (which also faults the pages in)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        buf = torch.ones(num_bytes // 4, dtype=torch.float32)  # written once: every page is resident
        buf.sum()
        seconds = []
        for _ in range(num_passes):
            start = time.perf_counter()
            buf.sum()
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    passes = [buf.nbytes / s / 1e9 for s in seconds]
    return {
        "method": f"torch.sum over a {buf.nbytes / 2**30:.2f} GiB float32 buffer, {num_threads} threads",
        "buffer_bytes": buf.nbytes,
        "num_threads": num_threads,
        "passes_gb_s": passes,
        "gb_s": statistics.median(passes),
    }


def streaming_floor(tensor_bytes: int, gb_s: float) -> float:
    """Batch-1 decode tokens/s if a step did nothing but read the file's tensors at `gb_s`."""
    return gb_s * 1e9 / tensor_bytes


def _status(pid: int) -> dict[str, int]:
    """`RSS_FIELDS` of one process in bytes ({} once it has gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in RSS_FIELDS:
            out[key] = int(value.split()[0]) * 1024  # "1234 kB"
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from each thread's /proc children list."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return tree


class RssWatch:
    """Samples a process tree's resident memory on a thread, from `start()` until `stop()`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.num_samples = 0
        self.peak: dict[str, int] = {}
        self.hwm: dict[int, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> RssWatch:
        self._thread.start()
        return self

    def _sample(self) -> None:
        total: dict[str, int] = {}
        for p in process_tree(self.pid):
            status = _status(p)
            if "VmHWM" in status:
                self.hwm[p] = status["VmHWM"]
            for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                total[key] = total.get(key, 0) + status.get(key, 0)
        self.num_samples += 1
        if total.get("VmRSS", 0) > self.peak.get("VmRSS", 0):
            self.peak = total

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY_S):
            self._sample()

    def stop(self) -> dict[str, Any]:
        """The figures (bytes): `peak_rss` = max(the sampled tree's peak, the server's VmHWM)."""
        self._done.set()
        self._thread.join()
        self._sample()  # the last state, and every process's final VmHWM
        if not self.peak:
            return {}
        return {
            "peak_rss": max(self.peak["VmRSS"], self.hwm.get(self.pid, 0)),
            "sampled_peak": self.peak,
            "vm_hwm": {str(p): v for p, v in self.hwm.items()},
            "num_processes": len(self.hwm),
            "num_samples": self.num_samples,
            "sample_every_s": SAMPLE_EVERY_S,
        }


def machine_memory() -> dict[str, Any]:
    """Total and available memory (bytes) and the cores this process may run on."""
    fields = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"mem_total_bytes": fields.get("MemTotal"), "mem_available_bytes": fields.get("MemAvailable"),
            "cores": cores}  # fmt: skip
