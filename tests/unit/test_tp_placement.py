"""Where tensor-parallel ranks run (model_executor/tp_placement.py), on a machine without a GPU:
the CPU placement, CUDA's placement and backend with the GPU count and NCCL faked, and the
refusals. benchmarks/gpu/tp_check.py runs the real NCCL engine where GPUs are."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llmserve.config import ModelConfig
from llmserve.engine.llm import build_engine
from llmserve.model_executor.tp_placement import place_ranks


def test_cpu_ranks_share_the_engines_options():
    placement = place_ranks("cpu", 2)
    assert placement.backend == "gloo" and placement.device(1) == torch.device("cpu")
    config = ModelConfig(model="m")
    assert placement.model_config(config, 1) is config


def _gpus(monkeypatch, count: int, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


def test_cuda_rank_r_runs_on_gpu_r_over_nccl(monkeypatch):
    _gpus(monkeypatch, 4)
    placement = place_ranks("cuda", 2)
    assert placement.backend == "nccl"
    assert [placement.device(r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    config = placement.model_config(ModelConfig(model="m", device="cuda"), 1)
    assert config.device == "cuda:1" and config.enforce_eager  # the hooks' collectives run eagerly


@pytest.mark.parametrize(
    ("device", "gpus", "nccl", "backend", "message"),
    [
        ("cuda", 1, True, "mp", r"tensor_parallel_size 2 needs 2 GPUs \(rank r on cuda:r\); 1 visible"),
        ("cuda:1", 4, True, "mp", "places rank r on cuda:r itself; device 'cuda:1' names one GPU"),
        ("cuda", 4, False, "mp", "needs NCCL; this torch build has none"),
        ("cuda", 4, True, "ray", "executor backend 'mp'"),
    ],
)
def test_cuda_refusals(monkeypatch, device, gpus, nccl, backend, message):
    _gpus(monkeypatch, gpus, nccl)
    with pytest.raises(ValueError, match=message):
        place_ranks(device, 2, backend)


def test_engine_refuses_before_loading(monkeypatch):
    """The engine's own path: a refusal names the GPUs before any shard loads or worker starts."""
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        build_engine("/nonexistent/model", device="cuda", tensor_parallel_size=2, show_progress=False)
