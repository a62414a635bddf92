"""PNG plots of benchmark results (the dicts `BenchmarkResult.to_dict()` returns).

    plot_latencies      TTFT, TPOT, ITL and E2E latency histograms of one run, in one figure
    plot_sweep          output throughput vs median TTFT, one labelled point per run
    plot_sweep_series   the same for several servers (a line each), e.g. llmserve vs llama-server

matplotlib is optional (`pip install llmserve[bench]`): it is imported on first use, and only its
object API with the Agg canvas is used, so no global pyplot backend is switched for the caller.
`MissingPlotDependency` (an ImportError) says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "plots need matplotlib: pip install llmserve[bench]"

_PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


class MissingPlotDependency(ImportError):
    pass


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingPlotDependency(INSTALL_HINT) from e
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _samples(result: Mapping[str, Any], key: str) -> list[float]:
    values: list[float] = []
    for r in result.get("requests", []):
        if not r.get("success"):
            continue
        v = r.get(key)
        if isinstance(v, list):
            values.extend(v)
        elif v is not None:
            values.append(v)
    return values


def _title(result: Mapping[str, Any]) -> str:
    conc = result.get("max_concurrency")
    return (
        f"{result.get('model', '?')} @ {result.get('base_url', '?')}: "
        f"{result.get('completed', 0)} requests, concurrency {conc if conc else 'unlimited'}, "
        f"rate {result.get('request_rate', 'inf')} req/s"
    )


def plot_latencies(result_dict: Mapping[str, Any], path: str | Path) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E latency (ms) with median and p99 marked."""
    fig = _figure(11, 7)
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, label) in zip(axes, _PANELS, strict=True):
        values = _samples(result_dict, key)
        ax.set_title(label)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
        name = key.removesuffix("_ms")
        for stat, style in (("median", "-"), ("p99", "--")):
            x = result_dict.get(f"{stat}_{name}_ms")
            if x is not None:
                ax.axvline(x, color="tab:red", linestyle=style, label=f"{stat} {x:.1f} ms")
        ax.legend(fontsize="small")
    fig.suptitle(_title(result_dict), fontsize="medium")
    fig.savefig(path)
    return Path(path)


def _point_label(result: Mapping[str, Any]) -> str:
    conc = result.get("max_concurrency")
    return f"c={conc}" if conc else f"rate={result.get('request_rate', 'inf')}"


def plot_sweep_series(
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
    labels: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Output throughput (tok/s) vs median TTFT (ms): one line per named series, one labelled
    point per result (default label: its concurrency). Runs with no completed request are left out."""
    fig = _figure(8, 6)
    ax = fig.subplots()
    for name, results in series.items():
        names = list(labels[name]) if labels and name in labels else [_point_label(r) for r in results]
        if len(names) != len(results):
            raise ValueError(f"series {name!r}: {len(names)} labels for {len(results)} results")
        points = [(r, n) for r, n in zip(results, names, strict=True) if r.get("completed")]
        xs = [r["median_ttft_ms"] for r, _ in points]
        ys = [r["output_throughput"] for r, _ in points]
        ax.plot(xs, ys, marker="o", label=name or None)
        for x, y, (_, text) in zip(xs, ys, points, strict=True):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 5), fontsize="small")
    ax.set_title("output throughput vs median TTFT (one point per run)")
    ax.set_xlabel("median TTFT (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.grid(True, alpha=0.3)
    if any(series):
        ax.legend()
    fig.savefig(path)
    return Path(path)


def plot_sweep(
    list_of_result_dicts: Sequence[Mapping[str, Any]] | None,
    path: str | Path,
    labels: Sequence[str] | None = None,
    *,
    series: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> Path:
    """One server's sweep (`list_of_result_dicts`, with optional point `labels`), or several
    servers' at once with `series={"llmserve": [...], "llama-server": [...]}`."""
    all_series: dict[str, Sequence[Mapping[str, Any]]] = {}
    all_labels: dict[str, Sequence[str]] = {}
    if list_of_result_dicts:
        all_series[""] = list_of_result_dicts
        if labels is not None:
            all_labels[""] = labels
    all_series.update(series or {})
    if not all_series:
        raise ValueError("plot_sweep needs results or series")
    return plot_sweep_series(all_series, path, all_labels or None)
