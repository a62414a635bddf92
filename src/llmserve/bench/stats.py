"""Summary statistics of a serving benchmark, in vLLM's key style.

    completed, failed, duration_s, total_input_tokens, total_output_tokens,
    request_throughput, output_throughput, total_token_throughput, request_goodput,
    {mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms

Token totals and latencies count successful requests only. TPOT skips requests with fewer than two
output tokens; ITL pools the gaps of every request. A metric with no data is 0.0 (as vLLM reports
it), so the JSON stays plain numbers. Goodput: requests/s that met every given SLO (ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from llmserve.bench.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def distribution(values_ms: Sequence[float], name: str) -> dict[str, float]:
    """mean, median, std and percentiles of one latency metric (numpy's linear percentiles)."""
    # no samples: all 0.0, as vLLM reports it (np.mean of an empty list would be NaN)
    values = np.asarray(values_ms if len(values_ms) else [0.0], dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values, p))
    return out


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A successful request that met every SLO (a single-token answer has no TPOT to miss)."""
    if not record.success:
        return False
    measured = {"ttft": record.ttft * 1e3, "tpot": (record.tpot or 0.0) * 1e3, "e2el": record.latency * 1e3}
    return all(measured[name] <= limit for name, limit in slos.items())


def latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples in ms over the successful requests."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }


def summarize(
    records: Sequence[RequestRecord], duration_s: float, goodput: dict[str, float] | None = None
) -> dict[str, float | int | None]:
    """The benchmark's summary metrics (flat dict, JSON-ready)."""
    ok = [r for r in records if r.success]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    summary: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) * per_s,
        "output_throughput": num_out * per_s,
        "total_token_throughput": (num_in + num_out) * per_s,
        "request_goodput": None,
    }
    if goodput:
        summary["request_goodput"] = sum(meets_slos(r, goodput) for r in ok) * per_s
    for name, values in latencies_ms(records).items():
        summary.update(distribution(values, name))
    return summary
