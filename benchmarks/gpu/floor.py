"""The batch-1 floor: every weight matrix of the model read once per step, by plain cuBLAS matvecs.

A decode step at batch 1 must read every weight once, so no engine can beat the time these
matvecs take on the same GPU (GPU.md: 1.15 ms for the 1.07B model on an H100, 867 tok/s). The
step is `torch.mv(W, x, out=y)` for each [out, in] matrix of the checkpoint - q, k, v, o, gate,
up, down of every layer, and the tied embedding as the LM head - recorded once into a CUDA graph,
so launch overhead is gone, then replayed many times between CUDA events. On the CPU (`--smoke`)
the same matvecs run eagerly, timed by the wall clock, and are labelled so.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

NUM_TRIALS = 5


def weight_matrices(folder: Path) -> dict[str, torch.Tensor]:
    """Every 2-D tensor of the checkpoint: the matrices a decode step multiplies by. An untied
    model's input embedding is left out (a step reads one row of it, not the matrix)."""
    from safetensors import safe_open

    matrices = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensor = f.get_tensor(name)
                if tensor.dim() == 2:
                    matrices[name] = tensor
    if "lm_head.weight" in matrices:
        matrices.pop("model.embed_tokens.weight", None)
    if not matrices:
        raise ValueError(f"no weight matrices in {folder}")
    return matrices


def measure_floor(folder: Path, device: str, dtype: str, num_replays: int) -> dict[str, Any]:
    """ms per step (median of NUM_TRIALS trials of `num_replays` steps), tok/s at batch 1, GB/s."""
    dev = torch.device(device)
    mode, trials, num_matrices, weight_bytes = _measure(folder, dev, getattr(torch, dtype), num_replays)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the weights are gone: a server started next sizes its KV cache from free memory
    ms = statistics.median(trials)
    return {
        "mode": mode,
        "device": str(dev),
        "dtype": dtype,
        "num_matrices": num_matrices,
        "weight_bytes": weight_bytes,
        "num_replays": num_replays,
        "trials_ms": trials,
        "ms_per_step": ms,
        "tok_s": 1e3 / ms,
        "gb_s": weight_bytes / (ms * 1e-3) / 1e9,
    }


def _measure(
    folder: Path, dev: torch.device, dtype: torch.dtype, num_replays: int
) -> tuple[str, list[float], int, int]:
    """(mode, ms per step of each trial, matrices, bytes read per step); the tensors die on return."""
    weights = [w.to(device=dev, dtype=dtype) for w in weight_matrices(folder).values()]
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(n, generator=gen).to(dev, dtype) for n in {w.shape[1] for w in weights}}
    ys = [torch.empty(w.shape[0], device=dev, dtype=dtype) for w in weights]

    def step() -> None:
        for w, y in zip(weights, ys, strict=True):
            torch.mv(w, xs[w.shape[1]], out=y)  # y[out] = W[out, in] @ x[in]

    if dev.type == "cuda":
        mode, trials = "CUDA graph replay of cuBLAS matvecs", _time_graph(step, dev, num_replays)
    else:
        mode, trials = f"eager matvecs on {dev.type} (no CUDA graph)", _time_eager(step, num_replays)
    return mode, trials, len(weights), sum(w.nbytes for w in weights)


def _time_graph(step: Any, dev: torch.device, num_replays: int) -> list[float]:
    """Capture `step` in one CUDA graph (after a warm-up on a side stream, as torch's docs ask),
    then time NUM_TRIALS x `num_replays` replays with CUDA events; ms per step per trial."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):  # cuBLAS picks its kernels and workspace before the capture
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
    trials = []
    for _ in range(NUM_TRIALS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_replays):
            graph.replay()
        end.record()
        end.synchronize()
        trials.append(start.elapsed_time(end) / num_replays)
    return trials


def _time_eager(step: Any, num_replays: int) -> list[float]:
    step()  # warm-up
    trials = []
    for _ in range(NUM_TRIALS):
        start = time.perf_counter()
        for _ in range(num_replays):
            step()
        trials.append(1e3 * (time.perf_counter() - start) / num_replays)
    return trials
