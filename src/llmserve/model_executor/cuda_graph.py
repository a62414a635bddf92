"""`GraphRunner`: decode steps replayed from CUDA graphs, padded to a fixed set of batch sizes.

A decode step of a 1B model is ~500 kernel launches; launched one by one from Python the GPU idles
~90% of the step (GPU.md). A CUDA graph records a step's launches once and replays them with one
call. A graph replays against the same memory with the same shapes, so:

  1. sizes: graphs are captured at start-up for batch sizes 1, 2, 4, 8, 16, 24, ... (steps of 8,
     vLLM's list) up to the engine's `max_num_seqs`; a decode batch runs in the smallest size that
     holds it, the extra rows decoding one token each in the pad block (a block no sequence owns);
  2. shapes: every replay has the same block-table width (the longest context's blocks) and one
     token per sequence (`max_query_len` 1), so the attention kernels' grids never change;
  3. memory: the step's inputs live in the forward runner's persistent buffers (input_buffers.py),
     written before each replay; the output is the graph's own tensor, sliced to the real rows.

Prefill chunks, mixed batches and decode batches larger than the largest size run eagerly.

Without CUDA (`capture=False`: the CPU, CI) the same padded, fixed-shape step runs eagerly through
the same code ("eager replay"), which is how the padding and buffer logic is tested.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from llmserve.model_executor.input_buffers import ForwardOutput, SequenceBatchEntry

logger = logging.getLogger("llmserve")

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8, up to the first that holds
    `max_num_seqs` (at most 512)."""
    sizes = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in sizes if s < limit] + [next(s for s in sizes if s >= limit)]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Collect the garbage now, then no automatic collection until the block ends (the previous
    setting is restored, also on an error).

    Why captures need it: an engine dropped by its user (or a server's unloaded model) is cyclic
    garbage, and its CUDA graphs are destroyed only when the collector finds it. Destroying a graph
    is not allowed while a stream is capturing, so a collection that ran in the middle of a capture
    voided that capture ("operation failed due to a previous error during capture", seen on an H100
    when test files created engines one after another). torch's own `torch.cuda.graph` stopped
    collecting before a capture (torch.compiler.config.force_cudagraph_gc, off by default)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphRunner:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """`runner`: the ForwardRunner whose buffers and stack the graphs replay. `capture`: record
        CUDA graphs (else every padded step runs eagerly)."""
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // runner.block_size)  # block-table width of every replay
        self.capture_enabled = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._generation = -1  # the input buffers' allocation the graphs were captured on
        # Room for the largest padded step, before any capture (a growth would void the graphs).
        runner.buffers.ensure(self.sizes[-1], self.sizes[-1], self.width)

    def padded_size(self, num_seqs: int) -> int | None:
        """The capture size a batch of `num_seqs` decodes runs in (None: too many)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def applies(self, batch: list[SequenceBatchEntry]) -> bool:
        """A decode batch (one new token per sequence) of at most the largest size, whose
        sequences fit the fixed block-table width."""
        return len(batch) <= self.sizes[-1] and all(
            len(e.new_token_ids) == 1 and len(e.block_ids) <= self.width for e in batch
        )

    def pad(self, batch: list[SequenceBatchEntry], size: int) -> list[SequenceBatchEntry]:
        """`batch` plus rows that decode token 0 at position 0 in the pad block."""
        pad = SequenceBatchEntry([0], 1, [self.runner.pad_block])
        return batch + [pad] * (size - len(batch))

    def forward(
        self, batch: list[SequenceBatchEntry], logits_rows: Sequence[int] | None = None
    ) -> ForwardOutput:
        """Hidden states [len(batch), hidden] of a decode batch (a graph replay, or the same
        padded step run eagerly), with the padded step's metadata."""
        size = self.padded_size(len(batch))
        assert size is not None and self.applies(batch)
        inputs = self.runner.prepare(self.pad(batch, size), width=self.width, logits_rows=logits_rows)
        graph = self.graphs.get(size)
        if graph is not None and self._generation == self.runner.buffers.generation:
            graph.replay()
            hidden = self.outputs[size][: len(batch)]
        else:
            if self.graphs:  # the buffers were reallocated under the graphs: they read freed memory
                logger.warning("CUDA graphs dropped: the step buffers grew after capture; running eagerly")
                self.graphs.clear()
                self.outputs.clear()
            hidden = self.runner.run(inputs)[: len(batch)]
        return ForwardOutput(hidden, inputs.metadata, inputs.logits_rows)

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> tuple[float, int]:
        """Record a graph for every size, largest first (the smaller ones then fit in the memory
        pool the largest allocated); (seconds, bytes of GPU memory it took)."""
        if not self.capture_enabled:
            return 0.0, 0
        with collection_paused():  # (before measuring: a dead engine's memory is freed first)
            return self._capture(show_progress)

    def _capture(self, show_progress: bool) -> tuple[float, int]:
        device = self.runner.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for backend in self.runner.backends:  # workspaces allocated now, not during a capture
            reserve = getattr(backend, "reserve", None)
            if reserve is not None:
                for p in self.runner.layer_params:
                    reserve(self.sizes[-1], p.num_heads, p.num_kv_heads, p.head_dim, device)
        sizes = sorted(self.sizes, reverse=True)
        for size in tqdm(sizes, desc="Capturing CUDA graphs", unit="graph", disable=not show_progress):
            inputs = self.runner.prepare(self.pad([], size), width=self.width)
            for _ in range(2):  # compile the Triton kernels and settle allocations eagerly first
                self.runner.run(inputs)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe calls void the capture, not another thread's
            # (a server thread unloading another model destroys that model's graphs)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[size] = self.runner.run(inputs)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self._generation = self.runner.buffers.generation
        seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
            len(sizes), sizes[-1], sizes[0], seconds, used / 2**20,
        )  # fmt: skip
        return seconds, used
