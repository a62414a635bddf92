"""The report of one run: the machine, one table per GGUF file, issue 30's targets, the plot.

    machine   gpu/report.py's environment (versions, commit, CPU name) plus the CPU family, memory
              and the source state each llmserve start imported
    table     per file: llmserve and llama-server side by side (c=1 tok/s, its own streaming floor
              from the bandwidth passes just before and after it, c=1 tok/s / floor (the target:
              prefill included) and decode alone / floor (1000 / median TPOT), c=16 tok/s and
              median TTFT, median TPOTs, peak RSS) and their ratios
    targets   issue 30's four per file, met / not met / not measured; a missed target never fails the run
    plot      bars per file and server: c=1 tok/s (the floor marked), c=16 tok/s, c=16 TTFT, RSS

Reads only the result dict bench_cpu_scale.py assembles; runs nothing but `lscpu`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from cpu_scale.cpu_time import NOISY
from cpu_scale.memory import machine_memory
from gpu.report import Target, environment

GiB = 2**30
# (what, server key path, digits): the table's columns; c1 and cN are the workload's two levels
COLUMNS = (
    ("c=1 tok/s", ("c1", "output_throughput"), 1),
    ("c=1 floor tok/s", ("floor", "floor_tok_s"), 1),
    ("c=1 / floor", ("c1", "floor_fraction"), 2),
    ("c=1 decode / floor", ("c1", "decode_floor_fraction"), 2),
    ("c=1 median TPOT ms", ("c1", "median_tpot_ms"), 1),
    ("c=16 tok/s", ("cN", "output_throughput"), 1),
    ("c=16 median TPOT ms", ("cN", "median_tpot_ms"), 1),
    ("c=16 median TTFT ms", ("cN", "median_ttft_ms"), 0),
    ("peak RSS GiB", ("memory", "peak_rss"), 2),
)
# Issue 30's targets, each file, llmserve at default flags against the floor and llama-server
TARGETS = (
    Target("c=1 / streaming floor", 0.8, "min", "x"),
    Target("c=16 tok/s, llmserve / llama-server", 2.0, "min", "x"),
    Target("c=16 median TTFT, llmserve / llama-server", 0.5, "max", "x"),
    Target("peak RSS, llmserve / llama-server", 1.3, "max", "x"),
)


def machine() -> dict[str, Any]:
    env = environment("cpu")
    for key in ("cuda", "triton", "device"):
        env.pop(key, None)
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    flags = fields.get("Flags", "").split()
    env.update(
        cpu_family=fields.get("CPU family"),
        cpu_model=fields.get("Model"),
        l3=fields.get("L3 cache"),
        avx512_vnni="avx512_vnni" in flags,
        hypervisor=fields.get("Hypervisor vendor"),
        mem_total_bytes=machine_memory()["mem_total_bytes"],
    )
    return env


def figure(server: dict[str, Any], cs: tuple[int, ...], key: tuple[str, str]) -> float | None:
    """One cell: a level's figure (c1 = the first level, cN = the last), RSS, the server's own c=1
    floor, or a c=1 fraction of it: output tok/s (prefill included) or decode's 1000 / median TPOT."""
    part, name = key
    if part in ("memory", "floor"):
        return server.get(part, {}).get(name)
    level = server.get("levels", {}).get(str(cs[0] if part == "c1" else cs[-1]), {})
    floor_tok_s = server.get("floor", {}).get("floor_tok_s")
    if name == "floor_fraction":
        tok_s = level.get("output_throughput")
        return tok_s / floor_tok_s if tok_s and floor_tok_s else None
    if name == "decode_floor_fraction":
        tpot = level.get("median_tpot_ms")
        return 1e3 / tpot / floor_tok_s if tpot and floor_tok_s else None
    return level.get(name)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def check_targets(entry: dict[str, Any], cs: tuple[int, ...]) -> list[dict[str, Any]]:
    ours, theirs = (entry["servers"].get(s, {}) for s in ("llmserve", "llama-server"))

    def both(key: tuple[str, str]) -> float | None:
        return _ratio(figure(ours, cs, key), figure(theirs, cs, key))

    values = (
        figure(ours, cs, ("c1", "floor_fraction")),
        both(("cN", "output_throughput")),
        both(("cN", "median_ttft_ms")),
        both(("memory", "peak_rss")),
    )
    return [t.check(v) for t, v in zip(TARGETS, values, strict=True)]


def _cell(value: float | None, digits: int, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value / scale:,.{digits}f}"


def format_file(name: str, entry: dict[str, Any], cs: tuple[int, ...]) -> str:
    facts = entry.get("file", {})
    head = (
        f"{name}: {facts.get('file_bytes', 0) / 1e6:,.0f} MB file, {facts.get('tensor_bytes', 0) / 1e6:,.0f} MB "
        f"of tensors ({', '.join(facts.get('tensor_bytes_by_type', {}))}); each c=1's streaming floor = "
        "bandwidth around it / these bytes"
    )
    lines = [head, "", "| server | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
             "| --- |" + " ---: |" * len(COLUMNS)]  # fmt: skip
    servers = entry.get("servers", {})
    for server, res in servers.items():
        if "levels" not in res:
            why = res.get("skipped") or res.get("error", "?")
            lines.append(f"| {server} | " + " | ".join(["-"] * len(COLUMNS)) + f" |  ({why.splitlines()[0]})")
            continue
        cells = [_cell(figure(res, cs, key), d, GiB if key[1] == "peak_rss" else 1) for _, key, d in COLUMNS]
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    ours, theirs = servers.get("llmserve", {}), servers.get("llama-server", {})
    if "levels" in ours and "levels" in theirs:
        cells = []
        for _, key, _ in COLUMNS:
            q = _ratio(figure(ours, cs, key), figure(theirs, cs, key))
            cells.append(f"{q:.2f}x" if q and key[0] not in ("floor",) and "floor" not in key[1] else "")
        lines.append("| llmserve / llama-server | " + " | ".join(cells) + " |")
    lines += _floor_lines(servers)
    lines += _memory_lines(servers)
    lines += _noise_lines(servers, cs)
    return "\n".join(lines)


def _noise_lines(servers: dict[str, Any], cs: tuple[int, ...]) -> list[str]:
    """Levels during which other processes took a share of the CPU (cpu_time.py): their figures are low."""
    lines = []
    for server, res in servers.items():
        for c in cs:
            cpu = res.get("levels", {}).get(str(c), {}).get("cpu", {})
            if cpu.get("other_cpu_fraction", 0) > NOISY:
                lines.append(f"  DISTURBED: {server} c={c}: other processes used {cpu['other_cpu_fraction']:.0%} "
                             f"of the machine meanwhile (this server {cpu['server_cpu_fraction']:.0%})")  # fmt: skip
    return lines


def _floor_lines(servers: dict[str, Any]) -> list[str]:
    """Each server's c=1 floor: the bandwidth just before and just after its c=1 level."""
    lines = []
    for server, res in servers.items():
        fl = res.get("floor")
        if fl and "gb_s" in fl:
            lo, hi = fl["floor_tok_s_range"]
            lines.append(
                f"  {server} c=1 floor: bandwidth {_cell(fl['gb_s_before'], 1)} GB/s before, "
                f"{_cell(fl['gb_s_after'], 1)} after ({fl['before'].get('reader') or fl['after'].get('reader')}"
                f" fastest): floor {fl['floor_tok_s']:.1f} tok/s ({lo:.1f}-{hi:.1f} at either end)"
            )
        elif fl:
            lines.append(f"  {server} c=1 floor: {fl.get('error', '?')}")
    return lines


def _memory_lines(servers: dict[str, Any]) -> list[str]:
    """Where each server's memory is: the sampled peak's anonymous and file-backed parts."""
    lines = []
    for server, res in servers.items():
        mem = res.get("memory", {})
        peak = mem.get("sampled_peak")
        if peak:
            lines.append(
                f"  {server}: VmHWM {mem['peak_rss'] / GiB:.2f} GiB; during the run at most {peak['VmRSS'] / GiB:.2f} GiB "
                f"= anon {peak['RssAnon'] / GiB:.2f} + file {peak['RssFile'] / GiB:.2f} + shmem "
                f"{peak['RssShmem'] / GiB:.2f} ({mem['num_processes']} process(es))"
            )
    return lines


def format_targets(result: dict[str, Any]) -> str:
    lines = ["targets (issue 30, the 1B model at default flags; never a failure of this run):"]
    if result["plan"]["name"] != "full":
        lines[0] = "targets (issue 30, stated for the 1B model: on this smoke run they are informative only):"
    for name, targets in result.get("targets", {}).items():
        for t in targets:
            state = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
            sign = ">=" if t["kind"] == "min" else "<="
            value = "-" if t["value"] is None else f"{t['value']:.2f}"
            lines.append(f"  {name}: {t['target']}: {value} ({sign} {t['bound']}): {state}")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    env = result.get("environment", {})
    w = result["plan"]["workload"]
    cs = tuple(c for c, _ in w["levels"])
    lines = [
        f"bench_cpu_scale ({result['plan']['name']}) on {env.get('cpu')} (family {env.get('cpu_family')}, "
        f"{env.get('cpu_cores')} cores, {(env.get('mem_total_bytes') or 0) / GiB:.0f} GiB); llmserve "
        f"{env.get('llmserve')} ({env.get('commit')}), torch {env.get('torch')}, {result['date']}",
        "floor: memory bandwidth measured just before and just after each server's c=1 level (the "
        "fastest of torch.sum (4 KiB and huge pages) and llmserve's q8 and q4 kernels at batch 1, median of "
        f"{result['plan']['bandwidth_passes']} passes each); floor = their mean / the file's tensor bytes",
        f"workload: {w['input_len']}-token random prompts, {w['output_len']} output tokens, EOS ignored; "
        + ", ".join(f"c={c}: {n} prompts" for c, n in w["levels"])
        + f"; {w['num_warmups']} warm-up request per level",
    ]
    for name, entry in result.get("files", {}).items():
        lines += ["", format_file(name, entry, cs)]
    for name, err in result.get("errors", {}).items():
        lines.append(f"FAILED {name}: {err.splitlines()[0] if err else '?'}")
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """bench_cpu_scale.png: four bar charts, files along x, one bar per server. None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("plot skipped: matplotlib is missing (pip install 'llmserve[bench]')")
        return None
    files = result.get("files", {})
    cs = tuple(c for c, _ in result["plan"]["workload"]["levels"])
    panels = (
        ("c=1 output tok/s", ("c1", "output_throughput"), 1),
        ("c=16 output tok/s", ("cN", "output_throughput"), 1),
        ("c=16 median TTFT (s)", ("cN", "median_ttft_ms"), 1e3),
        ("peak RSS (GiB)", ("memory", "peak_rss"), GiB),
    )
    fig = Figure(figsize=(14, 4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # the object API only: no global pyplot backend switched
    axes = fig.subplots(1, len(panels))
    x = list(range(len(files)))
    width = 0.38
    for ax, (label, key, scale) in zip(axes, panels, strict=True):
        for i, server in enumerate(("llmserve", "llama-server")):
            bars = [p + (i - 0.5) * width for p in x]
            values = [figure(e["servers"].get(server, {}), cs, key) for e in files.values()]
            ax.bar(bars, [(v or 0) / scale for v in values], width, label=server)
            if key == ("c1", "output_throughput"):  # each bar's own floor, from the passes around it
                floors = [figure(e["servers"].get(server, {}), cs, ("floor", "floor_tok_s")) or 0
                          for e in files.values()]  # fmt: skip
                ax.hlines(floors, [b - width / 2 for b in bars], [b + width / 2 for b in bars], colors="black",
                          label="streaming floor" if i == 0 else None, zorder=3)  # fmt: skip
        ax.set_xticks(x, list(files), fontsize="small")
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize="small")
    env = result.get("environment", {})
    fig.suptitle(f"bench_cpu_scale on {env.get('cpu')} ({env.get('cpu_cores')} cores), {result['date'][:10]}",
                 fontsize="medium")  # fmt: skip
    fig.savefig(path)
    return path
