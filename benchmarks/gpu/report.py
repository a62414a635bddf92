"""The report of one run: the machine and versions, GPU.md's table, issue 23's targets, a plot.

    environment   GPU name and memory, torch / CUDA / triton / transformers / llmserve versions, commit
    table         c = 1, 16, 64, 256 as columns (GPU.md's shape): served output tok/s, median TPOT and
                  TTFT (and the --enforce-eager run beside it), the floor at batch 1, then prefill and
                  the offline figures as lines
    targets       each of the issue's targets: value, bound, met / not met / not measured (a missed
                  target never fails the run)
    plot          output tok/s and latencies against concurrency, the floor and targets marked

Reads only the result dict bench_gpu.py assembles (see its docstring); runs nothing.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

VARIANTS = (("default", "served"), ("enforce-eager", "served --enforce-eager"))
# The table's rows for each served variant: (result key, label, decimals)
SERVED_ROWS = (
    ("output_throughput", "output tok/s", 1),
    ("median_tpot_ms", "median TPOT ms", 2),
    ("median_ttft_ms", "median TTFT ms", 1),
)


# ---------------------------------------------------------------- environment


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "llmserve": _version("llmserve"),
        "commit": _git("describe", "--always", "--dirty", "--abbrev=12"),
        "cpu": _cpu_name(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(
            gpu=torch.cuda.get_device_name(torch.device(device)),
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_driver=_nvidia_smi("driver_version"),
        )
    return env


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "?"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")


# ---------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    bound: float
    kind: Literal["min", "max"]
    unit: str

    def check(self, value: float | None) -> dict[str, Any]:
        met = None if value is None else (value >= self.bound if self.kind == "min" else value <= self.bound)
        return {
            "target": self.name,
            "value": value,
            "bound": self.bound,
            "kind": self.kind,
            "unit": self.unit,
            "met": met,
        }


# Issue 23's targets, for GPU_PLAN's model and workload on an H100
TARGETS = (
    Target("c=1 output tok/s", 650, "min", "tok/s"),
    Target("c=1 / floor", 0.75, "min", "x"),
    Target("c=1 median TTFT", 10, "max", "ms"),
    Target("c=64 output tok/s", 12_000, "min", "tok/s"),
    Target("c=256 output tok/s", 30_000, "min", "tok/s"),
    Target("prefill tok/s (8 x 2,048-token prompts)", 100_000, "min", "tok/s"),
)


def _level(report: dict[str, Any], variant: str, c: int, key: str) -> float | None:
    level = report.get("served", {}).get(variant, {}).get("levels", {}).get(str(c), {})
    return level.get(key)


def floor_fraction(report: dict[str, Any]) -> float | None:
    """c=1 served output tok/s as a fraction of the floor's tok/s (same run, same device)."""
    c1, floor = _level(report, "default", 1, "output_throughput"), report.get("floor", {}).get("tok_s")
    return c1 / floor if c1 and floor else None


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    prefill = report.get("served", {}).get("default", {}).get("prefill", {}).get("prefill_tok_s")
    values = (
        _level(report, "default", 1, "output_throughput"),
        floor_fraction(report),
        _level(report, "default", 1, "median_ttft_ms"),
        _level(report, "default", 64, "output_throughput"),
        _level(report, "default", 256, "output_throughput"),
        prefill,
    )
    return [t.check(v) for t, v in zip(TARGETS, values, strict=True)]


# ---------------------------------------------------------------- table


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_table(report: dict[str, Any], concurrency: tuple[int, ...]) -> str:
    env, floor = report.get("environment", {}), report.get("floor", {})
    device = env.get("gpu") or f"CPU ({env.get('cpu', '?')}, {env.get('cpu_cores', '?')} cores)"
    lines = [
        f"bench_gpu ({report['plan']['name']} plan) on {device}; torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, triton {env.get('triton')}, llmserve {env.get('llmserve')} ({env.get('commit')})",
        f"model: {report.get('model', {}).get('num_parameters', 0) / 1e9:.3f}B parameters, "
        f"{report['plan']['dtype']}; prompts {report['plan']['input_len']} tokens, "
        f"output {report['plan']['output_len']} tokens, EOS ignored",
        "",
        "| what | " + " | ".join(f"c={c}" for c in concurrency) + " |",
        "| --- |" + " ---: |" * len(concurrency),
    ]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    served = report.get("served", {})
    for variant, label in VARIANTS:
        if variant not in served:
            continue
        for key, what, digits in SERVED_ROWS:
            row(f"{label}: {what}", [_num(_level(report, variant, c, key), digits) for c in concurrency])
    if "enforce-eager" in served:
        ratios = []
        for c in concurrency:
            ours, eager = (_level(report, v, c, "output_throughput") for v in ("default", "enforce-eager"))
            ratios.append(f"{ours / eager:.2f}x" if ours and eager else "-")
        row("served / --enforce-eager, output tok/s", ratios)
    blanks = [""] * (len(concurrency) - 1)
    floor_cell = (
        f"{_num(floor.get('tok_s'))} ({_num(floor.get('ms_per_step'), 3)} ms)" if floor.get("tok_s") else "-"
    )
    row(f"floor: {floor.get('mode', 'matvecs')}, tok/s", [floor_cell, *blanks])
    fraction = floor_fraction(report)
    row("served c=1 / floor", [_num(fraction, 2), *blanks])
    lines.append("")
    lines += _extra_lines(report)
    return "\n".join(lines)


def _extra_lines(report: dict[str, Any]) -> list[str]:
    plan, floor, lines = report["plan"], report.get("floor", {}), []
    if floor.get("gb_s"):
        lines.append(
            f"floor: {floor['num_matrices']} matrices, {floor['weight_bytes'] / 2**30:.2f} GiB read per step "
            f"at {floor['gb_s']:,.0f} GB/s"
        )
    for variant, label in VARIANTS:
        prefill = report.get("served", {}).get(variant, {}).get("prefill", {})
        if variant in report.get("served", {}):
            lines.append(
                f"prefill ({label}, {plan['prefill_prompts']} x {plan['prefill_len']}-token prompts, 1 output "
                f"token): {_num(prefill.get('prefill_tok_s'))} tok/s, median TTFT "
                f"{_num(prefill.get('median_ttft_ms'))} ms"
            )
    latency, throughput = (
        report.get("offline", {}).get("latency", {}),
        report.get("offline", {}).get("throughput", {}),
    )
    if "offline" in report:
        lines.append(
            f"offline: bench latency pp{plan['latency_prompt_len']} {_num(latency.get('pp_tok_s'))} tok/s, "
            f"tg{plan['latency_gen_len']} {_num(latency.get('tg_tok_s'))} tok/s; bench throughput "
            f"{_num(throughput.get('output_tokens_per_second'))} output tok/s "
            f"({throughput.get('num_requests', '-')} requests at once)"
        )
    for name, part in report.get("errors", {}).items():
        lines.append(f"FAILED {name}: {part.splitlines()[0] if part else '?'}")
    return lines


def format_targets(targets: list[dict[str, Any]], plan_name: str) -> str:
    lines = ["targets (issue 23; never a failure of this run):"]
    if plan_name != "gpu":
        lines[0] = (
            "targets (issue 23, stated for the H100 plan: on this smoke run they are informative only):"
        )
    for t in targets:
        state = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        sign = ">=" if t["kind"] == "min" else "<="
        value = "-" if t["value"] is None else f"{t['value']:,.2f}"
        lines.append(f"  {t['target']}: {value} {t['unit']} ({sign} {t['bound']:,} {t['unit']}): {state}")
    return "\n".join(lines)


# ---------------------------------------------------------------- plot


def write_plot(report: dict[str, Any], concurrency: tuple[int, ...], path: Path) -> Path | None:
    """bench_gpu.png: output tok/s (log scale) and median TPOT/TTFT against concurrency, one line per
    served variant; the floor (batch 1) and the targets marked. None when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("plot skipped: matplotlib is missing (pip install 'llmserve[bench]')")
        return None
    fig = Figure(figsize=(12, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # the object API only: no global pyplot backend switched
    tput, tpot, ttft = fig.subplots(1, 3)
    for variant, label in VARIANTS:
        if variant not in report.get("served", {}):
            continue
        for ax, key in ((tput, "output_throughput"), (tpot, "median_tpot_ms"), (ttft, "median_ttft_ms")):
            points = [(c, _level(report, variant, c, key)) for c in concurrency]
            points = [(c, v) for c, v in points if v]
            ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=label)
    floor = report.get("floor", {})
    if floor.get("tok_s"):
        tput.axhline(floor["tok_s"], color="grey", linestyle="--", label="floor (batch 1)")
    if report["plan"]["name"] == "gpu":
        marks = [(1, 650), (64, 12_000), (256, 30_000)]
        tput.scatter(
            [c for c, _ in marks], [v for _, v in marks], marker="_", s=300, color="red", label="targets"
        )
    for ax, ylabel in ((tput, "output tok/s"), (tpot, "median TPOT (ms)"), (ttft, "median TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(concurrency), [str(c) for c in concurrency])
        ax.minorticks_off()
        ax.set(xlabel="concurrency", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    tput.set_yscale("log")
    env = report.get("environment", {})
    fig.suptitle(f"bench_gpu on {env.get('gpu') or 'CPU'} ({report['plan']['name']} plan)", fontsize="medium")
    fig.savefig(path)
    return path
