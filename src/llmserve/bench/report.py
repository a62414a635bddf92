"""Printing and saving benchmark results: vLLM-style text tables and JSON files."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from llmserve.bench.stats import PERCENTILES

_WIDTH = 50
_LATENCY_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:>10}"


def format_serving(result: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The summary of one `BenchmarkResult.to_dict()` as a text table."""
    lines = [f" {title} ".center(_WIDTH, "=")]
    conc = result.get("max_concurrency")
    lines += [
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
        _row("Maximum request concurrency:", conc if conc else "unlimited"),
        _row("Benchmark duration (s):", result["duration_s"]),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", result["output_throughput"]),
        _row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name, (heading, short) in _LATENCY_TITLES.items():
        lines.append(f"{heading}".center(_WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in PERCENTILES:
            lines.append(_row(f"P{p} {short} (ms):", result[f"p{p}_{name}_ms"]))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_sweep(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per concurrency level: the numbers a sweep is read for."""
    header = "| concurrency | completed | failed | req/s | output tok/s | median TTFT ms | median TPOT ms |"
    lines = [header, "|" + "|".join("---:" for _ in range(header.count("|") - 1)) + "|"]
    for r in results:
        lines.append(
            f"| {r.get('max_concurrency') or 'unlimited'} | {r['completed']} | {r['failed']} "
            f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {r['median_ttft_ms']:.1f} | {r['median_tpot_ms']:.1f} |"
        )
    return "\n".join(lines)


def default_result_path(kind: str, result_dir: str | Path | None, result_file: str | Path | None) -> Path:
    """`--result-file` (inside `--result-dir` when relative), else `bench-<kind>-<timestamp>.json`."""
    folder = Path(result_dir) if result_dir else Path.cwd()
    name = Path(result_file) if result_file else Path(f"bench-{kind}-{datetime.now():%Y%m%d-%H%M%S}.json")
    return name if name.is_absolute() else folder / name


def _finite(obj: Any) -> Any:
    """JSON has no inf/NaN: write them as strings, as vLLM does for an infinite request rate."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(data: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n")
    return path


def format_llama_bench(rows: Sequence[Mapping[str, Any]]) -> str:
    """llama-bench's table: `| model | device | test | t/s |` with mean ± std."""
    header = ["model", "device", "test", "t/s"]
    body = [
        [str(r["model"]), str(r["device"]), str(r["test"]), f"{r['mean_tps']:.2f} ± {r['std_tps']:.2f}"]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    sep = "| " + " | ".join("-" * w if i < 2 else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), sep, *(line(b) for b in body)])
