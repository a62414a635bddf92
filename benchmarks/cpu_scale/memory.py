"""Memory, both ways: how fast this machine streams it, and how much a server holds.

    bandwidth   readers over buffers many times the L3's size, on every core the servers get, in
                alternation: torch's sum over float32 (in 4 KiB pages, and in transparent huge
                pages where the kernel allows them), and llmserve's own q8 and q4 kernels at
                batch 1 (a decode step's read pattern, the matrix in huge pages as the server's
                weights); each the median of several passes, the fastest one taken: GB/s a decode
                step could read weights at. The streaming floor of a file is that bandwidth / the
                file's tensor bytes (a decode step at batch 1 reads every matrix once; the tied
                embedding, as the LM head, too); bench_cpu_scale measures it just before and just
                after each c=1 level (`floor_around`): this machine's bandwidth moves between
                ~50 and ~80 GB/s from minute to minute
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

SAMPLE_EVERY_S = 0.2
RSS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def _torch_sum(num_bytes: int) -> tuple[Callable[[], object], int]:
    """torch's sum over a float32 buffer (written once: every page is resident)."""
    import torch

    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return buf.sum, buf.nbytes


def _huge_pages(tensors: list[object]) -> bool:
    """The tensors' memory in transparent huge pages, as llmserve holds a model's weights
    (cpu_memory.back_with_huge_pages); False where that is not done (THP off, not Linux, no
    llmserve)."""
    try:
        from llmserve.model_executor.cpu_memory import back_with_huge_pages
    except ImportError:
        return False
    return back_with_huge_pages(tensors) > 0  # type: ignore[arg-type]


def _torch_sum_huge_pages(num_bytes: int) -> tuple[Callable[[], object], int] | None:
    """torch's sum over a float32 buffer in huge pages: a decode step's weights sit in huge pages,
    and a reader over 4 KiB pages reads a few percent slower (its floor would be too low). None
    where the buffer could not be put in huge pages."""
    import torch

    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return (buf.sum, buf.nbytes) if _huge_pages([buf]) else None


def _matvec(fmt: str, num_bytes: int) -> tuple[Callable[[], object], int] | None:
    """The fused decoder's own `fmt` kernel at batch 1 (`cpu_kernels.linear`, M = 1) over one
    [N, 8192] matrix of about `num_bytes`, in huge pages as the server's weights: the read pattern
    of a decode step, and a lower bound on what memory gives (it reads every byte in that time).
    q8's and q4's kernels stream differently (q4 does more work a byte, and reads 8 KB ahead
    where q8 reads 4), so each is a reader. None without llmserve's native kernels."""
    import torch

    from llmserve.layers.quantization import cpu_kernels
    from llmserve.layers.quantization.formats import BLOCK, TILE, PackedWeight

    if not cpu_kernels.has_native_kernels():
        return None
    K = 8192
    nb = K // BLOCK
    # a block of 16 rows: 32 int8 (q8) or 16 bytes of nibbles (q4) a row, and a float16 scale a row
    block_bytes = TILE * ((BLOCK if fmt == "q8" else BLOCK // 2) + 2)
    num_tiles = max(1, num_bytes // (nb * block_bytes))
    # pack()'s layouts: q8 [tiles, blocks, 16 pairs, 16 rows, 2] int8, q4 [tiles, blocks, 4 groups,
    # 16 rows, 2 lanes, 2 bytes] uint8 (symmetric: no minimums); scales [tiles, blocks, 16 rows]
    data = (
        torch.ones(num_tiles, nb, BLOCK // 2, TILE, 2, dtype=torch.int8)
        if fmt == "q8"
        else torch.full((num_tiles, nb, 4, TILE, 2, 2), 0x99, dtype=torch.uint8)
    )
    scales = torch.full((num_tiles, nb, TILE), 1e-3, dtype=torch.float16)
    w = PackedWeight(fmt, data, scales, None, num_tiles * TILE, K)  # type: ignore[arg-type]
    _huge_pages(w.tensors())
    x = torch.ones(1, K)
    return (lambda: cpu_kernels.linear(x, w)), w.nbytes()


READERS: dict[str, Callable[[int], tuple[Callable[[], object], int] | None]] = {
    "torch.sum float32": _torch_sum,
    "torch.sum float32, huge pages": _torch_sum_huge_pages,
    "q8 matvec (llmserve's kernel, batch 1)": lambda n: _matvec("q8", n),
    "q4 matvec (llmserve's kernel, batch 1)": lambda n: _matvec("q4", n),
}


def measure_bandwidth(num_bytes: int, num_passes: int, num_threads: int) -> dict[str, Any]:
    """Read bandwidth in GB/s (1e9 bytes): each of `READERS` over its own buffer of about
    `num_bytes`, pass by pass in alternation (both see the same seconds of a drifting machine),
    `num_passes` timed passes each after one untimed pass (which also faults the pages in). A
    reader's figure is the median of its passes; `gb_s` is the fastest reader's (no reader reads
    faster than memory gives, so the highest is the honest one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        readers = {name: r for name, make in READERS.items() if (r := make(num_bytes)) is not None}
        seconds: dict[str, list[float]] = {name: [] for name in readers}
        for read, _ in readers.values():
            read()
        for _ in range(num_passes):
            for name, (read, _) in readers.items():
                start = time.perf_counter()
                read()
                seconds[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    by_reader = {}
    for name, (_, nbytes) in readers.items():
        passes = [nbytes / s / 1e9 for s in seconds[name]]
        by_reader[name] = {"buffer_bytes": nbytes, "passes_gb_s": passes, "gb_s": statistics.median(passes)}
    best = max(by_reader, key=lambda name: by_reader[name]["gb_s"])
    return {
        "method": f"fastest of {', '.join(by_reader)} over ~{num_bytes / 2**30:.2f} GiB, {num_threads} threads",
        "reader": best,
        "readers": by_reader,
        "num_threads": num_threads,
        "passes_gb_s": by_reader[best]["passes_gb_s"],
        "gb_s": by_reader[best]["gb_s"],
    }


def floor_around(before: dict[str, Any], after: dict[str, Any], tensor_bytes: int) -> dict[str, Any]:
    """A c=1 measurement's floor from the bandwidth passes just before and just after it: their
    mean (GB/s), and the floor at each end (the drift while it ran)."""
    ends = [b["gb_s"] for b in (before, after) if "gb_s" in b]
    if not ends:
        return {"error": "no bandwidth measured around this level"}
    gb_s = statistics.mean(ends)
    return {
        "gb_s": gb_s,
        "gb_s_before": before.get("gb_s"),
        "gb_s_after": after.get("gb_s"),
        "floor_tok_s": streaming_floor(tensor_bytes, gb_s),
        "floor_tok_s_range": [
            streaming_floor(tensor_bytes, min(ends)),
            streaming_floor(tensor_bytes, max(ends)),
        ],
        "before": before,
        "after": after,
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
