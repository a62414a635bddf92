"""When each benchmark request is sent: gamma-distributed inter-arrival times.

With rate R requests/s and burstiness B, the gaps are Gamma(shape=B, scale=1/(R*B)): mean 1/R for
every B; B = 1 is a Poisson process, B < 1 burstier, B > 1 more regular. R = inf sends everything
at once. Does not know what is sent.
"""

from __future__ import annotations

import math

import numpy as np


def interarrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Gaps in seconds before each of `num_requests` requests (all 0.0 for an infinite rate)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=num_requests).tolist()


def send_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets from the benchmark's start at which each request is sent; the first goes at 0."""
    gaps = interarrival_times(num_requests, request_rate, burstiness, seed)
    # the first request does not wait: gap i separates request i from request i+1
    return [0.0, *np.cumsum(gaps[:-1]).tolist()] if num_requests else []
