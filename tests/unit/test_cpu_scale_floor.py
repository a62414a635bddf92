"""benchmarks/cpu_scale (issue 30's CPU benchmark): the bandwidth readers, each c=1 level's own
streaming floor from the passes around it, and how the report reads it. The full script runs in
tests/e2e/test_bench_cpu_scale.py; these are its pieces on hand-made figures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def cpu_scale() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from cpu_scale import memory, report

        yield memory, report
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_measure_bandwidth_takes_the_fastest_reader(cpu_scale: Any) -> None:
    import torch

    from llmserve.layers.quantization import cpu_kernels

    memory, _ = cpu_scale
    bw = memory.measure_bandwidth(32 * 2**20, 3, 1)
    expected = {"torch.sum float32"} | (
        {"q8 matvec (llmserve's kernel, batch 1)", "q4 matvec (llmserve's kernel, batch 1)"}
        if cpu_kernels.has_native_kernels()
        else set()
    )
    huge = "torch.sum float32, huge pages"
    assert set(bw["readers"]) - {huge} == expected
    if memory._huge_pages([torch.ones(4 * 2**20)]):  # where this machine gives huge pages: read there too
        assert huge in bw["readers"]
    for reader in bw["readers"].values():
        assert len(reader["passes_gb_s"]) == 3 and reader["gb_s"] > 0
        assert abs(reader["buffer_bytes"] - 32 * 2**20) <= 16 * 256 * 34  # a whole number of q8 tiles
    assert bw["gb_s"] == max(r["gb_s"] for r in bw["readers"].values())
    assert bw["passes_gb_s"] == bw["readers"][bw["reader"]]["passes_gb_s"]


def test_floor_around_a_level_is_the_mean_of_its_two_passes(cpu_scale: Any) -> None:
    memory, _ = cpu_scale
    floor = memory.floor_around({"gb_s": 40.0}, {"gb_s": 50.0}, 500 * 10**6)
    assert floor["gb_s"] == 45.0 and floor["floor_tok_s"] == pytest.approx(90.0)
    assert floor["floor_tok_s_range"] == pytest.approx([80.0, 100.0])
    # a failed pass on one side leaves the other; none at all is an error, not a figure
    assert memory.floor_around({"error": "x"}, {"gb_s": 50.0}, 500 * 10**6)["floor_tok_s"] == 100.0
    assert "error" in memory.floor_around({"error": "x"}, {}, 500 * 10**6)


def _server(tok_s: float, tpot_ms: float, floor_tok_s: float) -> dict[str, Any]:
    c1 = {"output_throughput": tok_s, "median_tpot_ms": tpot_ms}
    c16 = {"output_throughput": 100.0, "median_tpot_ms": 90.0, "median_ttft_ms": 2000.0}
    floor = {"gb_s": 50.0, "gb_s_before": 48.0, "gb_s_after": 52.0, "floor_tok_s": floor_tok_s,
             "floor_tok_s_range": [floor_tok_s - 1, floor_tok_s + 1], "before": {"reader": "torch.sum float32"},
             "after": {"reader": "torch.sum float32"}}  # fmt: skip
    return {"levels": {"1": c1, "16": c16}, "floor": floor, "memory": {"peak_rss": 2**30}}


def test_each_server_is_read_against_its_own_floor(cpu_scale: Any) -> None:
    _, report = cpu_scale
    cs = (1, 16)
    ours, theirs = _server(40.0, 20.0, 80.0), _server(30.0, 25.0, 60.0)
    assert report.figure(ours, cs, ("c1", "floor_fraction")) == pytest.approx(0.5)
    assert report.figure(ours, cs, ("c1", "decode_floor_fraction")) == pytest.approx(50.0 / 80.0)
    assert report.figure(theirs, cs, ("c1", "floor_fraction")) == pytest.approx(0.5)
    assert report.figure(ours, cs, ("floor", "floor_tok_s")) == 80.0
    assert report.figure({"levels": {"1": {"output_throughput": 1.0}}}, cs, ("c1", "floor_fraction")) is None
    entry = {"file": {"tensor_bytes": 10**9}, "servers": {"llmserve": ours, "llama-server": theirs}}
    target = report.check_targets(entry, cs)[0]
    assert target["value"] == pytest.approx(0.5) and target["met"] is False
    text = report.format_file("1b-q4_0", entry, cs)
    assert "| llmserve | 40.0 | 80.0 | 0.50 | 0.62 | 20.0 | 100.0 |" in text
    assert (
        "  llmserve c=1 floor: bandwidth 48.0 GB/s before, 52.0 after (torch.sum float32 fastest): " in text
    )
    assert "| llmserve / llama-server | 1.33x |  |  |  | 0.80x | 1.00x |" in text  # no ratio of floors
